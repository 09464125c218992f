#!/usr/bin/env python3
"""bench/sim_table.py: one markdown table row per simulator output directory.

usage: bench/sim_table.py [--target LOSS] runs/exp/e1-* …
Columns: final and best validation loss, final consensus distance, mean H, bytes one
worker sends per round (and as a multiple of the fp32 model), simulated wall-clock, compute
utilisation (inner-step time over simulated wall time; "-" for runs from before it), and with
--target the simulated time of the first evaluation at or below LOSS.
"""
import json
import sys
from pathlib import Path


def main(argv):
    target = None
    if argv[:1] == ["--target"]:
        target, argv = float(argv[1]), argv[2:]
    head = "| run | final val | best val | consensus | mean H | bytes/worker/round | × fp32 model | sim time (s) | utilisation |"
    if target is not None:
        head += f" time to ≤ {target} (s) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for d in argv:
        doc = json.loads((Path(d) / "rounds.json").read_text())
        s = doc["summary"]
        row = (
            f"| {Path(d).name} | {s['final_val_loss']:.4f} | {s['best_val_loss']:.4f} | "
            f"{s['final_consensus']:.2e} | {s['inner_steps_mean']:.1f} | "
            f"{s['bytes_per_worker_round']:.0f} | {s['bytes_per_worker_round'] / s['model_bytes_fp32']:.3f} | "
            f"{s['sim_time_s']:.1f} | "
            + (f"{s['compute_utilization']:.3f} |" if "compute_utilization" in s else "- |")
        )
        if target is not None:
            hit = next(
                (r["sim_time_s"] for r in doc["rounds"] if r["val_loss"] is not None and r["val_loss"] <= target),
                None,
            )
            row += f" {hit:.1f} |" if hit is not None else " not reached |"
        print(row)


if __name__ == "__main__":
    main(sys.argv[1:])
