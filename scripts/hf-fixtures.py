#!/usr/bin/env python3
"""Writes the Hugging Face parity fixtures under tests/fixtures/hf/ (run by hand; CI only reads them).

    python3 scripts/hf-fixtures.py [--out tests/fixtures/hf]

Needs torch and transformers. For each supported variant it builds a tiny random model with
transformers itself (2 layers, f32, eager attention, no dropout), a fixed batch of 4 x 32
tokens, and runs one training step of plain SGD (lr 0.1, mean cross-entropy over every
token), writing into <out>/<variant>/:

    config.json, model.safetensors   the model as save_pretrained writes it (the weights before)
    data.safetensors                 tokens [4, 32] and targets [4, 32] (the next tokens), i64
    expected.safetensors             logits [4, 32, vocab]; loss [1]; grad.<name> and
                                     after.<name> (the weights after the step) per parameter
    meta.json                        lr, batch, versions
    generate.json                    greedy generation: prompts (token ids) and the tokens
                                     transformers' `generate` adds to each (KV cache on)

executor/tests/hf_parity.rs trains the same step with shardplan on several meshes and
compares the loss, the logits, and each parameter's update; executor/tests/generate.rs
decodes the prompts greedily and compares the tokens.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

BATCH, SEQ, LR, SEED = 4, 32, 0.1, 1234
# Greedy generation: prompt lengths and new tokens per prompt (prompt + new stays within the
# shortest context of any variant, Mistral's 32-token window).
PROMPT_LENS, NEW_TOKENS = (1, 5, 11), 12
# A prompt is kept only if at every step the chosen token's logit leads the runner-up by
# this much (random tiny models have close logits; a near tie would make the comparison
# depend on rounding).
MIN_MARGIN = 1e-4

LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)

VARIANTS = {
    # Llama with grouped-query attention, untied head.
    "llama": (LlamaForCausalLM, LlamaConfig(**LLAMA)),
    # An explicit head_dim that is not hidden_size / heads, and Llama 3's RoPE base.
    "llama-head-dim": (LlamaForCausalLM, LlamaConfig(**{**LLAMA, "head_dim": 16, "rope_theta": 500000.0})),
    # Llama 3.1's frequency scaling, every branch of it (kept, blended, divided), and the
    # linear one.
    "llama-rope-llama3": (
        LlamaForCausalLM,
        LlamaConfig(
            **{
                **LLAMA,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 0.5,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            }
        ),
    ),
    "llama-rope-linear": (LlamaForCausalLM, LlamaConfig(**{**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})),
    "llama-rope-yarn": (
        LlamaForCausalLM,
        LlamaConfig(**{**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    ),
    # Other MLP activations: exact gelu, its tanh approximation, relu.
    "llama-gelu": (LlamaForCausalLM, LlamaConfig(**{**LLAMA, "hidden_act": "gelu"})),
    "llama-gelu-tanh": (LlamaForCausalLM, LlamaConfig(**{**LLAMA, "hidden_act": "gelu_pytorch_tanh"})),
    "llama-relu": (LlamaForCausalLM, LlamaConfig(**{**LLAMA, "hidden_act": "relu"})),
    "mistral": (MistralForCausalLM, MistralConfig(**{**LLAMA, "sliding_window": None})),
    # A window as long as the sequences: the banded mask is the causal mask.
    "mistral-window": (MistralForCausalLM, MistralConfig(**{**LLAMA, "sliding_window": SEQ})),
    # Qwen2: q/k/v biases; tied and untied embeddings.
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config(**{**LLAMA, "tie_word_embeddings": True, "use_sliding_window": False})),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**{**LLAMA, "use_sliding_window": False})),
    # GPT-2 with sizes that shard unevenly over 4 ranks (vocab 131 rows, 36-wide).
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config(
            vocab_size=131,
            n_embd=36,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
        ),
    ),
}
# GPT-2 with exact gelu.
VARIANTS["gpt2-gelu"] = (GPT2LMHeadModel, GPT2Config(**{**VARIANTS["gpt2"][1].to_dict(), "activation_function": "gelu"}))

# Qwen3: per-head RMSNorm on queries and keys, a head_dim that is not hidden_size / heads.
VARIANTS["qwen3"] = (Qwen3ForCausalLM, Qwen3Config(**{**LLAMA, "head_dim": 16, "use_sliding_window": False}))
# Mixtures of experts: 4 routed experts, 2 per token (so EP 2 and EP 4 split them), no
# router noise, no load-balancing loss in the model's loss (output_router_logits is off, as
# the published configs ship).
MOE = dict(LLAMA, num_experts_per_tok=2)
VARIANTS["mixtral"] = (
    MixtralForCausalLM,
    MixtralConfig(**{**MOE, "num_local_experts": 4, "sliding_window": None, "router_jitter_noise": 0.0}),
)
# Qwen2-MoE: narrower experts, the shared expert behind its sigmoid gate, q/k/v biases, the
# chosen scores not renormalised (norm_topk_prob false, the published value).
VARIANTS["qwen2-moe"] = (
    Qwen2MoeForCausalLM,
    Qwen2MoeConfig(
        **{
            **MOE,
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "use_sliding_window": False,
        }
    ),
)
# Qwen3-MoE: renormalised scores (norm_topk_prob true, the published value), per-head q/k
# norms, three layers of which the first is dense (mlp_only_layers [0]).
VARIANTS["qwen3-moe"] = (
    Qwen3MoeForCausalLM,
    Qwen3MoeConfig(
        **{
            **MOE,
            "num_hidden_layers": 3,
            "head_dim": 8,
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            "use_sliding_window": False,
        }
    ),
)
MOE_VARIANTS = {"mixtral", "qwen2-moe", "qwen3-moe"}
# The smallest lead of a token's k-th routing score over its (k+1)-th in any MoE layer: a
# near tie would let rounding pick another expert in shardplan than in transformers.
MIN_ROUTE_MARGIN = 1e-4


def write(out, name, cls, config):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(SEED)
    config._attn_implementation = "eager"
    model = cls(config).float()
    # Random biases too (transformers initialises them to zero), so they are checked.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.02)
            # Routers 25x wider than the default init: decisive routing, so a batch without
            # near ties exists (at 0.02 every score is close to 1 / experts).
            if name in MOE_VARIANTS and n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(d, safe_serialization=True)
    # Generation defaults are not part of the fixture.
    gen = os.path.join(d, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    g = torch.Generator().manual_seed(SEED + 1)
    for _ in range(100):
        seqs = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=g)
        tokens, targets = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
        margin = route_margin(model, config, tokens) if name in MOE_VARIANTS else None
        if margin is None or margin >= MIN_ROUTE_MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no batch without a near tie in routing")
    save_file({"tokens": tokens, "targets": targets}, os.path.join(d, "data.safetensors"))
    model.train()
    logits = model(input_ids=tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
    loss.backward()
    expected = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    # Under the checkpoint's names: transformers keeps a layer's experts fused in memory
    # (experts.gate_up_proj) but saves them one by one (experts.N.gate_proj.weight), so the
    # gradients and the updated weights go through save_pretrained too.
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(p.grad)
        for n, t in saved(model).items():
            expected[f"grad.{n}"] = t
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    with torch.no_grad():
        before = load_file(os.path.join(d, "model.safetensors"))
        for n, t in expected.copy().items():
            if n.startswith("grad."):
                expected[f"after.{n[5:]}"] = (before[n[5:]] - LR * t).contiguous()
    save_file(expected, os.path.join(d, "expected.safetensors"))
    meta = {
        "lr": LR,
        "batch": BATCH,
        "seq": SEQ,
        "loss": loss.item(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parameters": sorted(k[6:] for k in expected if k.startswith("after.")),
    }
    if margin is not None:
        meta["min_route_margin"] = margin
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    write_generations(d, model, config)
    print(f"{name}: loss {loss.item():.6f}, {sum(p.numel() for p in model.parameters())} parameters -> {d}")


def saved(model):
    """The model's tensors as save_pretrained writes them (the checkpoint's names)."""
    with tempfile.TemporaryDirectory() as t:
        model.save_pretrained(t, safe_serialization=True)
        return {n: v.contiguous() for n, v in load_file(os.path.join(t, "model.safetensors")).items()}


def route_margin(model, config, tokens):
    """The smallest lead of the k-th softmax routing score over the (k+1)-th, over every
    token of every MoE layer, read from the input of each router (`mlp.gate`)."""
    k, margins, hooks = config.num_experts_per_tok, [], []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "weight") or gate.weight.shape[0] != getattr(config, "num_experts", getattr(config, "num_local_experts", None)):
            continue

        def hook(mod, args, _out):
            x = args[0].reshape(-1, mod.weight.shape[1])
            p = torch.softmax(x @ mod.weight.t(), dim=-1).topk(k + 1, dim=-1).values
            margins.append((p[:, k - 1] - p[:, k]).min().item())

        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    return min(margins)


def write_generations(d, model, config):
    """Greedy `generate` (KV cache on) from a few random prompts, with the smallest lead of
    the chosen token at any step."""
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(SEED + 2)
    prompts, outputs, margins = [], [], []
    for n in PROMPT_LENS:
        for _ in range(20):
            prompt = torch.randint(0, config.vocab_size, (1, n), generator=g)
            with torch.no_grad():
                out = model.generate(
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    use_cache=True,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            top2 = [s[0].topk(2).values for s in out.scores]
            margin = min((t[0] - t[1]).item() for t in top2)
            if margin >= MIN_MARGIN:
                prompts.append(prompt[0].tolist())
                outputs.append(out.sequences[0, n:].tolist())
                margins.append(margin)
                break
        else:
            raise SystemExit(f"{d}: no prompt of length {n} without a near tie")
    with open(os.path.join(d, "generate.json"), "w") as f:
        json.dump({"max_new_tokens": NEW_TOKENS, "prompts": prompts, "outputs": outputs, "min_margin": min(margins)}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf"))
    ap.add_argument("--only", nargs="*", help="write these variants only (default: every one)")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for name, (cls, config) in VARIANTS.items():
        if not a.only or name in a.only:
            write(a.out, name, cls, config)


if __name__ == "__main__":
    main()
