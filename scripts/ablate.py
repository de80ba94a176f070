"""The recipe ablation (issue 15): drafter variants trained for the same wall-clock budget on one
self-distilled data set, each measured by `serving.bench` on the same prompts, in one table.

    python scripts/ablate.py                                  # every row of scripts/ablation.yaml
    python scripts/ablate.py --rows baseline lr-3e-4 --minutes 5 --out ablation-quick

A row is `training.run` with the file's `train` overrides, then the row's own, for `minutes` of
wall clock (`trainer.max_minutes`: equal steps would favour the variants whose steps are cheap),
reading the target's hidden states from the offline cache: `training.dump` writes it once per data
and capture setting, and the rows that change neither share it. Then `serving.bench` with the
file's `bench` overrides. Resumable: a row already in the table is kept, a finished training is
benched without being rerun, an interrupted one resumes (`trainer.resume=auto`), a complete cache is
reused, a failed row is tried again. Writes <out>/table.json and <out>/table.md, and where rows
measure real acceptance as they train (scripts/curves.yaml), their learning curves in
<out>/curves.json and <out>/curves.png.

    python scripts/ablate.py --config scripts/curves.yaml --out curves   # three families' curves
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from drafters.storage.writes import atomic_file  # noqa: E402

# overrides that leave the hidden-state cache as it is: the rest (data, seed, target, the drafter
# family or its capture layers) get a cache of their own (a wrong guess is refused by the cache's index)
CACHE_FREE = ("trainer.", "drafter.", "logger")
CAPTURE = ("drafter.aux_layers", "drafter.num_aux")
# a row trains until its budget ends, evaluating only then, unless the plan says otherwise (curves.yaml)
RUN_DEFAULTS = {"trainer.max_steps": 1000000, "trainer.eval_every": 1000000, "trainer.save_every": 50}


def cache_key(overrides: list[str]) -> str:
    changes = sorted(o for o in overrides if not o.startswith(CACHE_FREE) or o.startswith(CAPTURE))
    return hashlib.sha256(json.dumps(changes).encode()).hexdigest()[:12] if changes else "shared"


def run(module: str, args: list[str], log: str) -> None:
    """`python -m module args` in the folder of `log` (Hydra's logs go there), its output into `log`;
    a failure raises with the log's last line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    with open(log, "a") as handle:
        done = subprocess.run([sys.executable, "-m", module, *args], cwd=os.path.dirname(log), env=env, stdout=handle,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        with open(log) as handle:
            last = [line.strip() for line in handle if line.strip()][-1:] or ["no output"]
        raise RuntimeError(f"{module} exited {done.returncode}: {last[0]} (log: {log})")


def train_and_bench(name: str, overrides: list[str], plan: dict, out: str) -> dict:
    row_dir = os.path.join(out, "rows", name)
    os.makedirs(row_dir, exist_ok=True)
    train = [*plan["train"], *overrides, "data.hidden_states=offline",
             f"data.cache.dir={os.path.join(out, 'hidden', cache_key(overrides))}"]
    trained = os.path.join(row_dir, "trained.json")  # a finished run is not resumed: it would refuse
    if not os.path.exists(trained):
        run("training.dump", [*train, f"hydra.run.dir={os.path.join(row_dir, 'dump')}"], os.path.join(row_dir, "dump.log"))
        began = time.perf_counter()
        unset = [f"{key}={value}" for key, value in RUN_DEFAULTS.items() if not any(o.startswith(key + "=") for o in train)]
        run("training.run", [*train, *unset, f"trainer.max_minutes={plan['minutes']}", "trainer.resume=auto",
                             f"hydra.run.dir={os.path.join(row_dir, 'train')}"], os.path.join(row_dir, "train.log"))
        write_json(trained, {"seconds": time.perf_counter() - began})
    with open(trained) as handle:
        train_seconds = json.load(handle)["seconds"]
    checkpoint = os.path.join(row_dir, "train", "checkpoints", "latest")
    run("serving.bench", [f"artifact={checkpoint}", *plan["bench"], f"out={os.path.join(row_dir, 'bench.json')}", "overwrite=true"],
        os.path.join(row_dir, "bench.log"))
    with open(os.path.join(row_dir, "train", "metrics.jsonl")) as handle:
        final_eval = [record for record in map(json.loads, handle) if "eval/sim_accept_len" in record][-1]
    with open(os.path.join(row_dir, "bench.json")) as handle:
        bench = json.load(handle)["datasets"]
    return {"overrides": overrides, "steps": final_eval["step"], "train_minutes": train_seconds / 60,
            "sim_accept_len": final_eval["eval/sim_accept_len"], "acc_1": final_eval.get("eval/acc/1"),
            "accept_len": {set_name: result["accept_len"] for set_name, result in bench.items()},
            "speedup": {set_name: result["speedup"] for set_name, result in bench.items()}}


def machine() -> str:
    """The kind of machine a row's budget buys its training on, e.g. `AMD EPYC, CPU AVX2, no native bf16,
    1 thread` (OMP_NUM_THREADS=1 keeps other work on the second core from slowing a row down)."""
    import torch

    from drafters.target import precision

    hardware = precision.probe("cuda" if torch.cuda.is_available() else "cpu")
    return (f"{hardware.name}, {hardware.device.upper()} {hardware.capability}, {'native' if hardware.native_bf16 else 'no native'} "
            f"bf16, {hardware.threads} thread{'s' if hardware.threads > 1 else ''}")


def write_json(path: str, value: dict) -> None:
    with atomic_file(path, key="ablation table") as partial, open(partial, "w") as handle:
        json.dump(value, handle, indent=1)


def curves(table: dict, out: str) -> dict:
    """Each row's learning curve, where its trainer measured real acceptance (`eval/accept_len`:
    the serving engine on held-out prompts, `trainer.eval_accept_prompts`) against the training
    tokens it had seen, and the acceptance at which its chain breaks even: its bench's accept_len /
    speed-up (the iteration's cost in plain steps), averaged over the sets. Writes curves.json and
    curves.png in `out` when any row has a curve; returns the curves."""
    found = {}
    for name, row in table["rows"].items():
        path = os.path.join(out, "rows", name, "train", "metrics.jsonl")
        if "accept_len" not in row or not os.path.exists(path):
            continue
        with open(path) as handle:
            points = [(r["train/tokens"], r["eval/accept_len"]) for r in map(json.loads, handle) if "eval/accept_len" in r]
        if points:
            even = sum(row["accept_len"][s] / row["speedup"][s] for s in row["accept_len"]) / len(row["accept_len"])
            found[name] = {"tokens": [t for t, _ in points], "accept_len": [a for _, a in points], "break_even": even,
                           "pays_from_tokens": next((t for t, a in points if a > even), None)}
    if found:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, curve in found.items():
            line, = ax.plot(curve["tokens"], curve["accept_len"], marker="o", label=name)
            ax.axhline(curve["break_even"], color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set(xscale="log", xlabel="training tokens", ylabel="measured tokens / target forward",
               title=f"acceptance against training ({table['minutes']} min a row; dashed: break-even)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        with atomic_file(os.path.join(out, "curves.png"), key="learning curves") as partial:
            fig.savefig(partial, dpi=100, format="png")
        plt.close(fig)
        write_json(os.path.join(out, "curves.json"), found)
    return found


def markdown(table: dict) -> str:
    sets = next((list(row["accept_len"]) for row in table["rows"].values() if "accept_len" in row), [])
    lines = [f"Budget {table['minutes']} min a row on {table['machine']}; `train`: `{' '.join(table['train'])}`; `bench`: "
             f"`{' '.join(table['bench'])}`.", "",
             "| row | overrides | steps | train min | sim accept | acc@1 | " + " | ".join(sets) + " | mean |",
             "|---|---|---|---|---|---|" + "---|" * (len(sets) + 1)]
    for name, row in table["rows"].items():
        if "error" in row:
            lines.append(f"| {name} | `{' '.join(row['overrides'])}` | failed: {row['error']} |")
            continue
        measured = [f"{row['accept_len'][s]:.2f} ({row['speedup'][s]:.2f}x)" for s in sets]
        mean = sum(row["accept_len"].values()) / len(row["accept_len"])
        lines.append(f"| {name} | `{' '.join(row['overrides']) or '-'}` | {row['steps']} | {row['train_minutes']:.1f} | "
                     f"{row['sim_accept_len']:.3f} | {row['acc_1']:.3f} | " + " | ".join(measured) + f" | {mean:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "scripts", "ablation.yaml"))
    parser.add_argument("--rows", nargs="*", help="the rows to run (default: every row of the config)")
    parser.add_argument("--minutes", type=float, help="the training budget of a row (default: the config's)")
    parser.add_argument("--out", default="ablation")
    args = parser.parse_args()
    try:
        with open(args.config) as handle:
            plan = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as error:
        why = getattr(error, "strerror", None) or " ".join(str(error).split())  # YAML's message spans lines
        print(f"error: --config {args.config}: {why}", file=sys.stderr)
        return 2
    wanted = {"minutes": (int, float), "train": list, "bench": list, "rows": dict}
    wrong = [key for key, kind in wanted.items() if not isinstance(plan, dict) or not isinstance(plan.get(key), kind)]
    if wrong:
        print(f"error: --config {args.config}: needs {', '.join(wrong)} (minutes: a number, train and bench: lists "
              "of overrides, rows: name -> list of overrides)", file=sys.stderr)
        return 2
    plan["minutes"] = args.minutes or plan["minutes"]
    unknown = sorted(set(args.rows or []) - set(plan["rows"]))
    if unknown:
        print(f"error: --rows {' '.join(unknown)}: not in {args.config} (it has {', '.join(plan['rows'])})", file=sys.stderr)
        return 2
    names = args.rows or list(plan["rows"])
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "table.json")
    table = {"rows": {}}
    if os.path.exists(path):
        with open(path) as handle:
            table = json.load(handle)
    if table.get("minutes", plan["minutes"]) != plan["minutes"]:
        print(f"error: {path} holds rows trained for {table['minutes']} min, not {plan['minutes']}: "
              "give another --out", file=sys.stderr)
        return 2
    here = machine()
    if table.get("machine", here) != here:  # a wall-clock budget buys different training on another machine
        print(f"error: {path} holds rows measured on {table['machine']}, not on this {here}: give another --out",
              file=sys.stderr)
        return 2
    table.update(minutes=plan["minutes"], machine=here, train=plan["train"], bench=plan["bench"])
    began, todo = time.perf_counter(), [name for name in names if "accept_len" not in table["rows"].get(name, {})]
    for number, name in enumerate(todo, 1):
        per_row = (time.perf_counter() - began) / max(number - 1, 1)
        eta = f", about {per_row * (len(todo) - number + 1) / 60:.0f} min left" if number > 1 else ""
        print(f"[{number}/{len(todo)}] {name}: {' '.join(plan['rows'][name]) or 'the base recipe'}{eta}", flush=True)
        try:
            table["rows"][name] = train_and_bench(name, list(plan["rows"][name]), plan, out)
        except RuntimeError as error:
            table["rows"][name] = {"overrides": list(plan["rows"][name]), "error": str(error)}
            print(f"error: row {name}: {error}", file=sys.stderr)
        table["rows"] = {row: table["rows"][row] for row in plan["rows"] if row in table["rows"]}  # the config's order
        write_json(path, table)
        with atomic_file(os.path.join(out, "table.md"), key="ablation table") as partial, open(partial, "w") as handle:
            handle.write(markdown(table))
    print(markdown(table))
    curves(table, out)
    return 1 if any("error" in row for row in table["rows"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
