#!/usr/bin/env python3
"""bench/swarm_report: what a swarm benchmark's configurations did, from their round records.

usage: swarm_report.py [--tokens-per-step N] OUT_DIR REFERENCE CONFIG [CONFIG ...]

Each configuration's directory OUT_DIR/<config>/ holds `period_ms` (the round period) and
node*/rounds.jsonl (`gasloc-node join --report`). A round's validation loss counts at the
wall-clock time its outer step was done, `round * period + round_s` from genesis; the swarm's
curve is the mean over the nodes that reported the round (at least all but one).

Printed per configuration: seconds until the swarm's mean validation loss first reaches the
target (the worst configuration's best mean, so that every configuration reaches it), its
best mean loss, compute utilisation (trainer busy time over wall time, all nodes), the same
from each node's second round on (`steady`: a node's first round also holds its joining and,
with overlapped rounds, an exchange that no earlier round's steps hid), the idle share
(1 − utilisation), the share of round time spent waiting for the exchange (`wait_s` over
`round_s`), inner steps, the exchanges that failed or were refused out of those the rounds
planned, where the trainer's time went besides its steps (the round records' `trainer_time`:
serving the round before between steps, waiting for its outer step, the hand-off and payload,
the deadline left unused; shares of the steady rounds' wall time), and each configuration's
time-to-target ratio against REFERENCE. With
--tokens-per-step (sequence length x micro-batch x accumulation), also the tokens per second of
one node (the nodes' mean, steady rounds): over wall time, and over the trainer's busy time.
"""
import glob
import json
import statistics
import sys


def load(out, config):
    period = int(open(f"{out}/{config}/period_ms").read()) / 1000
    points = {}  # round -> [(round_s, val_loss)]
    totals = dict(steps=0.0, wait=0.0, round=0.0, train=0.0, wall=0.0, steady_train=0.0, steady_wall=0.0, steady_steps=0.0, planned=0, failed=0)
    steady = []  # the records of every node's rounds after its first
    nodes = sorted(glob.glob(f"{out}/{config}/node*/rounds.jsonl"))
    for path in nodes:
        for i, line in enumerate(open(path)):
            r = json.loads(line)
            if i > 0:
                steady.append(r)
                totals["steady_train"] += r.get("train_s", 0.0)
                totals["steady_wall"] += r.get("wall_s", 0.0)
                totals["steady_steps"] += r["inner_steps"]
            totals["steps"] += r["inner_steps"]
            totals["planned"] += len(r.get("neighbours", []))
            totals["failed"] += len(r.get("failed", [])) + len(r.get("refused", []))
            totals["wait"] += r["wait_s"]
            totals["round"] += r["round_s"]
            totals["train"] += r.get("train_s", 0.0)
            totals["wall"] += r.get("wall_s", 0.0)
            if r.get("val_loss") is not None:
                points.setdefault(r["round"], []).append((r["round_s"], r["val_loss"]))
    curve = []
    for rnd in sorted(points):
        ends = [s for s, _ in points[rnd]]
        losses = [v for _, v in points[rnd]]
        if len(losses) >= max(1, len(nodes) - 1):
            curve.append((rnd * period + max(ends), sum(losses) / len(losses)))
    return dict(curve=curve, nodes=len(nodes), steady=steady, **totals)


def median(values):
    return statistics.median_high(values) if values else float("nan")


def main():
    args = sys.argv[1:]
    tokens_per_step = None
    if args[:1] == ["--tokens-per-step"]:
        tokens_per_step, args = int(args[1]), args[2:]
    if len(args) < 3:
        sys.exit(__doc__)
    out, reference, configs = args[0], args[1], args[2:]
    runs = {c: load(out, c) for c in configs}
    empty = [c for c, r in runs.items() if not r["curve"]]
    if empty:
        sys.exit(f"no validation losses from {', '.join(empty)}: see the logs in {out}")
    target = max(min(v for _, v in r["curve"]) for r in runs.values())
    print(f"target mean val_loss: {target:.4f} (the worst configuration's best)")
    reached = {}
    for c, r in runs.items():
        reached[c] = next(t for t, v in r["curve"] if v <= target)
        util = r["train"] / r["wall"] if r["wall"] else 0.0
        steady = r["steady_train"] / r["steady_wall"] if r["steady_wall"] else 0.0
        wait = r["wait"] / r["round"] if r["round"] else 0.0
        best = min(v for _, v in r["curve"])
        print(
            f"  {c:24s} time to target {reached[c]:6.1f} s   best mean val_loss {best:.4f}   "
            f"utilisation {util:.3f} (steady {steady:.3f})   idle share {1 - util:5.1%}   exchange wait {wait:5.1%}   "
            f"inner steps {r['steps']:.0f}   failed exchanges {r['failed']}/{r['planned']}"
        )
        if tokens_per_step and r["steady_wall"] and r["steady_train"]:
            tokens = r["steady_steps"] * tokens_per_step
            print(
                f"  {'':24s} tokens/s per node (steady): {tokens / r['steady_wall']:9.0f} over wall time, "
                f"{tokens / r['steady_train']:9.0f} while training"
            )
        rounds = r["steady"]
        print(
            f"  {'':24s} steady rounds' medians: H_i {median([x['inner_steps'] for x in rounds]):.0f}, "
            f"step {median([x['step_time_s'] for x in rounds]):.3f} s, exchange {median([x['exchange_s'] for x in rounds]):.2f} s "
            f"(transfer {median([x['transfer_s'] for x in rounds]):.2f} s), round {median([x['round_s'] for x in rounds]):.2f} s, "
            f"sent {median([x['bytes_sent'] for x in rounds]) / 1e6:.1f} MB"
        )
        # The trainer's time besides its steps, as shares of the steady rounds' wall time.
        if r["steady_wall"]:
            parts = {p: sum(x.get("trainer_time", {}).get(f"{p}_s", 0.0) for x in rounds) / r["steady_wall"]
                     for p in ("served", "waited", "payload", "unused")}
            print(
                f"  {'':24s} trainer's other time (steady, share of wall): between steps serving the round before "
                f"{parts['served']:.1%}, waiting for its outer step {parts['waited']:.1%}, "
                f"hand-off and payload {parts['payload']:.1%}, deadline left unused {parts['unused']:.1%}"
            )
    for c in configs:
        if c != reference:
            print(f"  ratio {c} / {reference} time to target: {reached[c] / reached[reference]:.2f}")


if __name__ == "__main__":
    main()
