"""PyTorch eager reference for bench/train_throughput.sh.

The same Llama-3-style model, AdamW and batch as gasloc's trainer (node/src/model.rs,
node/src/optim.rs), written the plain PyTorch way, on the same libtorch (.venv torch), the
same run manifest and the same token shards. Prints one `tokens_per_s=` line: the mean over
the timed steps (the first `--warmup` steps are not timed).

usage: train_reference.py --run RUN.toml --data DIR --steps N [--warmup W] [--device cpu]
"""
import argparse
import glob
import math
import os
import time
import tomllib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PRESETS = {  # d_model, n_layers, n_heads, n_kv_heads, tie_embeddings (proto/src/manifest.rs)
    "tiny": (64, 2, 4, 2, False),
    "16m": (256, 4, 4, 4, True),
    "125m": (768, 12, 12, 12, True),
}


def resolve(run):
    m, d = run.get("model", {}), run["data"]
    p = PRESETS.get(m.get("size"), (None, None, None, None, False))
    d_model = m.get("d_model", p[0])
    n_heads = m.get("n_heads", p[2])
    vocab = 256 if d["tokenizer"] == "byte" else 50304
    multiple = 256 if d_model >= 256 else 32
    return dict(
        vocab=m.get("vocab_size", vocab),
        d=d_model,
        layers=m.get("n_layers", p[1]),
        heads=n_heads,
        kv_heads=m.get("n_kv_heads", p[3] or n_heads),
        ffn=m.get("ffn_hidden", -(-(8 * d_model // 3) // multiple) * multiple),
        theta=m.get("rope_theta", 500000.0),
        eps=m.get("norm_eps", 1e-5),
        tied=m.get("tie_embeddings", p[4]),
        max_seq=max(d["seq_len"], 1024),
    )


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["d"], c["d"] // c["heads"]
        self.c, self.hd = c, hd
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, c["kv_heads"] * hd, bias=False)
        self.v_proj = nn.Linear(d, c["kv_heads"] * hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, c["ffn"], bias=False)
        self.up_proj = nn.Linear(d, c["ffn"], bias=False)
        self.down_proj = nn.Linear(c["ffn"], d, bias=False)

    def forward(self, x, cos, sin):
        c, hd = self.c, self.hd
        b, t, _ = x.shape
        h = F.rms_norm(x, (c["d"],), self.input_layernorm, c["eps"])
        q = self.q_proj(h).view(b, t, c["heads"], hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, c["kv_heads"], hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, c["kv_heads"], hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=c["kv_heads"] != c["heads"]
        )
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, c["d"]))
        h = F.rms_norm(x, (c["d"],), self.post_attention_layernorm, c["eps"])
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab"], c["d"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = nn.Parameter(torch.ones(c["d"]))
        self.lm_head = None if c["tied"] else nn.Linear(c["d"], c["vocab"], bias=False)
        hd = c["d"] // c["heads"]
        inv_freq = 1.0 / (c["theta"] ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(c["max_seq"]).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = F.rms_norm(x, (self.c["d"],), self.norm, self.c["eps"])
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def load_tokens(data_dir):
    shards = sorted(p for p in glob.glob(os.path.join(data_dir, "*.bin")) if "_val_" not in p)
    header = np.fromfile(shards[0], dtype="<i4", count=256)
    dtype = "<u2" if header[0] == 20240520 else "<u4"
    return np.fromfile(shards[0], dtype=dtype, offset=1024).astype(np.int64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with open(args.run, "rb") as f:
        run = tomllib.load(f)
    c = resolve(run)
    d, o = run["data"], run["optimizer"]
    seq, rows, accum = d["seq_len"], d["micro_batch"], d.get("grad_accum", 1)
    torch.manual_seed(run["seed"])
    model = Llama(c).to(args.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.get("weight_decay", 0.1)},
         {"params": other, "weight_decay": 0.0}],
        lr=o.get("lr", 4e-4), betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
        eps=o.get("eps", 1e-8),
    )
    tokens = torch.from_numpy(load_tokens(args.data))
    window = seq + 1
    n_windows = len(tokens) // window
    cursor = 0
    timed_tokens, timed_secs = 0, 0.0
    for step in range(args.steps + args.warmup):
        start = time.perf_counter()
        for _ in range(accum):
            idx = [(cursor + r) % n_windows for r in range(rows)]
            cursor += rows
            batch = torch.stack([tokens[i * window:(i + 1) * window] for i in idx]).to(args.device)
            loss = model(batch[:, :-1], batch[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.get("grad_clip", 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item() * accum
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
        if step >= args.warmup:
            timed_tokens += rows * seq * accum
            timed_secs += secs
    assert math.isfinite(loss_value)
    print(f"tokens_per_s={timed_tokens / timed_secs:.1f} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
