#!/usr/bin/env python3
"""Writes the Float8 fixture tests/fixtures/float8/casts.json (run by hand; CI only reads it).

    PYTHONPATH=... python3 scripts/float8-fixtures.py [--out tests/fixtures/float8/casts.json]

Needs torch and torchao (0.18: `pip install torchao` beside torch 2.15). Every float is
written as its f32 bit pattern (an integer), so the test compares bits:

    casts       per format (e4m3 = torch.float8_e4m3fn, e5m2 = torch.float8_e5m2): inputs and
                torchao's `to_fp8_saturated(x).float()` of each: every value of the format,
                the midpoints between neighbours (ties), values past the largest, zeros,
                infinities and a sweep of random magnitudes
    scales      amaxes and torchao's `amax_to_scale` of each, per format, with and without
                power-of-two rounding
    operands    per recipe (tensorwise, rowwise, rowwise_with_gw_hp) and per operand of the
                three matmuls of a linear (output: input x weight_t; grad_input:
                grad_output x weight_t.t(); grad_weight: grad_output.t() x input), the
                operand as torchao's emulated matmul reads it (`_data.float() / _scale`, or
                the high-precision tensor where the recipe keeps it), for random matrices
                with a zero row and values spread over many magnitudes

executor's float8 tests (executor/src/cpu/float8.rs) recompute each and compare bits.
"""
import argparse
import json
import math
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def bits(t):
    """The f32 bit patterns of `t` as a flat list of ints."""
    return t.detach().float().contiguous().view(torch.int32).flatten().tolist()


def cast_inputs(dtype, gen):
    """Inputs that reach every rounding case of `dtype`."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = every[torch.isfinite(every)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    top = torch.finfo(dtype).max
    edges = torch.tensor([0.0, -0.0, top * 1.03, top * 1.2, -top * 5, float("inf"), float("-inf"),
                          torch.finfo(dtype).tiny / 3, -torch.finfo(dtype).tiny / 7])
    sweep = torch.randn(1500, generator=gen) * torch.exp2(torch.randint(-24, 18, (1500,), generator=gen).float())
    return torch.cat([finite, mids, edges, sweep])


def matrix(rows, cols, gen):
    """A random matrix with one zero row and magnitudes over a range of 2^-12 .. 2^12."""
    m = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-12, 12, (rows, cols), generator=gen).float())
    m[rows // 3] = 0.0
    return m


def operands(recipe, x, w_t, go):
    """Each matmul operand of the linear `x @ w_t` (w_t = weight.t()) with output gradient
    `go`, as torchao's emulated matmuls read them under `recipe`."""
    from torchao.float8.config import Float8LinearConfig, ScalingType
    from torchao.float8.float8_linear import LinearMMConfig
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    c = Float8LinearConfig.from_recipe_name(recipe)
    mm = LinearMMConfig()

    def cast(t, cc, role, dim):
        if cc.scaling_type is ScalingType.DISABLED:
            return t
        f8 = hp_tensor_to_float8_dynamic(t, cc.target_dtype, mm, gemm_input_role=role,
                                         scaling_granularity=cc.scaling_granularity,
                                         axiswise_dim=get_maybe_axiswise_dim(dim, cc.scaling_granularity),
                                         round_scales_to_power_of_2=c.round_scales_to_power_of_2)
        return f8._data.float() / f8._scale

    return {
        "output.input": cast(x, c.cast_config_input, GemmInputRole.INPUT, -1),
        "output.weight_t": cast(w_t, c.cast_config_weight, GemmInputRole.WEIGHT, 0),
        "grad_input.grad_output": cast(go, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1),
        "grad_input.weight_t": cast(w_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1),
        "grad_weight.grad_output": cast(go, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0),
        "grad_weight.input": cast(x, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "float8", "casts.json"))
    a = ap.parse_args()
    import torchao
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    gen = torch.Generator().manual_seed(0)
    out = {"torch": torch.__version__, "torchao": torchao.__version__, "casts": {}, "scales": {}, "operands": []}
    for name, dtype in FORMATS.items():
        x = cast_inputs(dtype, gen)
        out["casts"][name] = {"input": bits(x), "output": bits(to_fp8_saturated(x, dtype).float())}
        amax = torch.cat([torch.tensor([0.0, 1e-30, 1.0, 448.0, 57344.0, 2.0 ** 20]),
                          torch.rand(300, generator=gen) * torch.exp2(torch.randint(-30, 30, (300,), generator=gen).float())])
        out["scales"][name] = {
            "amax": bits(amax),
            "scale": bits(torch.stack([amax_to_scale(v, dtype) for v in amax])),
            "scale_power_of_two": bits(torch.stack([amax_to_scale(v, dtype, round_scales_to_power_of_2=True)
                                                    for v in amax])),
        }
    m, k, n = 12, 40, 24
    for recipe in ["tensorwise", "rowwise", "rowwise_with_gw_hp"]:
        x, w, go = matrix(m, k, gen), matrix(n, k, gen), matrix(m, n, gen)
        ops = operands(recipe, x, w.t(), go)
        out["operands"].append({
            "recipe": recipe, "m": m, "k": k, "n": n,
            "input": bits(x), "weight": bits(w), "grad_output": bits(go),
            "expected": {name: bits(t) for name, t in ops.items()},
        })
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes)")


if __name__ == "__main__":
    main()
