"""The shoot-out table (markdown) from what scripts/shootout.sh wrote:
    python scripts/shootout_table.py runs/shootout/llama

One row per drafter and bench file (chain.json, tree.json, any other *.json a bench wrote there):
training time, the final simulated acceptance, and per set the measured acceptance length and
speed-up over plain decoding."""

from __future__ import annotations

import glob
import json
import os
import re
import sys


def last_eval(metrics_path: str) -> dict:
    evals = {}
    with open(metrics_path) as handle:
        for line in handle:
            record = json.loads(line)
            if "eval/sim_accept_len" in record:
                evals = record
    return evals


def describe(config: dict) -> str:
    if config["draft"] == "tree":
        return f"tree {config['depth']}/{config['topk']}/{config['total_tokens']}"
    if config.get("schedule") == "auto":
        return f"{config['draft']} {config['steps']}, schedule=auto"
    scheduled = config.get("min_confidence") or 0
    return f"chain {config['steps']}" + (f", conf >= {scheduled}" if scheduled else "")


def main(root: str) -> None:
    sets = ["mtbench", "humaneval", "gsm8k"]
    print("| drafter | trainable params | train time | sim. accept | serving | "
          + " | ".join(f"{name} accept / speed-up" for name in sets) + " |")
    print("|---" * (5 + len(sets)) + "|")
    for run in sorted(glob.glob(os.path.join(root, "*"))):
        if not os.path.exists(os.path.join(run, "train.done")):
            continue
        name = os.path.basename(run)
        seconds = int(open(os.path.join(run, "train.done")).read())
        evals = last_eval(os.path.join(run, "metrics.jsonl"))
        found = re.search(r"([0-9.]+)M trainable parameters", open(os.path.join(run, "run.log")).read())
        params = f"{found.group(1)} M" if found else "-"
        for bench in sorted(glob.glob(os.path.join(run, "*.json"))):
            result = json.load(open(bench))
            cells = []
            for set_name in sets:
                data = result["datasets"].get(set_name)
                cells.append(f"{data['accept_len']:.2f} / {data['speedup']:.2f}x" if data else "-")
            print(f"| {name} | {params} | {seconds // 60} min | {evals.get('eval/sim_accept_len', float('nan')):.3f} "
                  f"| {describe(result['config'])} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/shootout/llama")
