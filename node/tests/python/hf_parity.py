"""transformers' LlamaForCausalLM against gasloc, both directions.

  hf_parity.py check <checkpoint dir> <reference.safetensors>
      Loads a gasloc checkpoint with transformers and compares its logits for
      `tokens` with the `logits` gasloc computed (both in the reference file).
  hf_parity.py export <checkpoint dir> <out dir> <reference.safetensors>
      Builds a freshly initialised transformers model from the checkpoint's config.json,
      saves it with save_pretrained (a plain HF directory) and writes its logits for the
      reference file's `tokens` as `hf_logits` into <out dir>/hf_logits.safetensors.

Prints max_abs_diff=<x> for check and exits 1 when it exceeds the tolerance.
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

TOLERANCE = 1e-4


def check(ckpt: str, reference: str) -> int:
    ref = load_file(reference)
    tokens = ref["tokens"].to(torch.int64)
    expected = ref["logits"]
    model = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    if logits.shape != expected.shape:
        print(f"shape mismatch: transformers {tuple(logits.shape)} gasloc {tuple(expected.shape)}")
        return 1
    diff = (logits - expected).abs().max().item()
    scale = expected.abs().max().item()
    print(f"max_abs_diff={diff:.3e} max_abs_logit={scale:.3e}")
    return 0 if diff <= TOLERANCE * max(1.0, scale) else 1


def export(ckpt: str, out: str, reference: str) -> int:
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(ckpt)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokens = load_file(reference)["tokens"].to(torch.int64)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float().contiguous()
    save_file({"hf_logits": logits}, os.path.join(out, "hf_logits.safetensors"))
    print("exported")
    return 0


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    sys.exit(check(*args) if mode == "check" else export(*args))
