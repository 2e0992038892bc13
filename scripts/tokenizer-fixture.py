#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer/tokenizer.json: a byte-level BPE tokenizer (vocabulary
512, `<|endoftext|>` as its end-of-document token) trained with Hugging Face `tokenizers`
on the repository's README, for the tests of `shardplan data prepare`. Run by hand.

    python3 scripts/tokenizer-fixture.py
"""
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

root = os.path.join(os.path.dirname(__file__), "..")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=512,
    special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
)
tok.train([os.path.join(root, "README.md")], trainer)
out = os.path.join(root, "tests", "fixtures", "tokenizer", "tokenizer.json")
tok.save(out)
print(out, tok.get_vocab_size())
