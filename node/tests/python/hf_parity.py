"""Loads a gasloc checkpoint with transformers' LlamaForCausalLM and compares its logits
with the ones gasloc computed for the same tokens.

usage: hf_parity.py <checkpoint dir> <reference.safetensors>
The reference file holds `tokens` (int64 as float32 values) and `logits` (float32).
Prints max_abs_diff=<x> and exits 1 when it exceeds the tolerance.
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

TOLERANCE = 1e-4


def main() -> int:
    ckpt, reference = sys.argv[1], sys.argv[2]
    ref = load_file(reference)
    tokens = ref["tokens"].to(torch.int64)
    expected = ref["logits"]
    model = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    if logits.shape != expected.shape:
        print(f"shape mismatch: transformers {tuple(logits.shape)} gasloc {tuple(expected.shape)}")
        return 1
    diff = (logits - expected).abs().max().item()
    scale = expected.abs().max().item()
    print(f"max_abs_diff={diff:.3e} max_abs_logit={scale:.3e}")
    return 0 if diff <= TOLERANCE * max(1.0, scale) else 1


if __name__ == "__main__":
    sys.exit(main())
