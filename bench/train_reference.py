"""PyTorch eager reference for bench/train_throughput.sh.

The same Llama-3-style model, AdamW and batch as gasloc's trainer (node/src/model.rs,
node/src/optim.rs), written the plain PyTorch way, on the same libtorch (.venv torch), the
same run manifest and the same token shards. Prints one line: `tokens_per_s` (wall clock) and
`tokens_per_cpu_s` (process CPU time, all threads) over the timed steps (the first `--warmup`
steps are not timed).

usage: train_reference.py --run RUN.toml --data DIR --steps N [--warmup W] [--device cpu]

On CUDA it computes in bf16 (autocast) unless the manifest's `model.cuda_compute` is fp32.
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


def init_like_gasloc(model, c, std):
    """gasloc's init (node/src/model.rs): N(0, std²) for matrices and the embedding,
    N(0, std²/(2·layers)) for o_proj and down_proj, norm gains 1. PyTorch's module defaults
    (N(0, 1) embeddings) would saturate the softmax of a tied head and fill the backward
    pass with denormal floats, which are many times slower on x86: not a fair reference."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * c["layers"]))
            else:
                p.normal_(0.0, std)


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
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(args.run, "rb") as f:
        run = tomllib.load(f)
    c = resolve(run)
    d, o = run["data"], run["optimizer"]
    seq, rows, accum = d["seq_len"], d["micro_batch"], d.get("grad_accum", 1)
    torch.manual_seed(run["seed"])
    model = Llama(c)
    init_like_gasloc(model, c, run.get("model", {}).get("init_std", 0.02))
    model = model.to(args.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.get("weight_decay", 0.1)},
         {"params": other, "weight_decay": 0.0}],
        lr=o.get("lr", 4e-4), betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
        eps=o.get("eps", 1e-8),
    )
    # On CUDA the forward and backward run in bf16 under autocast unless the manifest says
    # fp32 (`cuda_compute`), as gasloc's model casts each weight to bf16 where it is used.
    bf16 = args.device.startswith("cuda") and run.get("model", {}).get("cuda_compute", "bf16") == "bf16"
    tokens = torch.from_numpy(load_tokens(args.data))
    window = seq + 1
    n_windows = len(tokens) // window
    cursor = 0
    timed_tokens, timed_secs, timed_cpu = 0, 0.0, 0.0
    for step in range(args.steps + args.warmup):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(accum):
            idx = [(cursor + r) % n_windows for r in range(rows)]
            cursor += rows
            batch = torch.stack([tokens[i * window:(i + 1) * window] for i in idx]).to(args.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = model(batch[:, :-1], batch[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.get("grad_clip", 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item() * accum
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        secs, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if step >= args.warmup:
            timed_tokens += rows * seq * accum
            timed_secs += secs
            timed_cpu += cpu
    assert math.isfinite(loss_value)
    print(
        f"tokens_per_s={timed_tokens / timed_secs:.1f} "
        f"tokens_per_cpu_s={timed_tokens / timed_cpu:.1f} threads={torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
