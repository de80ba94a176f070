"""The GPU check (issue 17), one command: `bash scripts/device_check.sh OUT` (see there).

Three parts, each timed, written to OUT/device_check.json and OUT/device_check.md as they finish
(a run cut short keeps what it measured):
1. kernels: each Triton kernel against its torch reference at serving shapes (outputs must be
   identical), both timed (median of many runs), with the memory-traffic floor of the kernel's
   bytes at this device's measured copy bandwidth;
2. training throughput (target tokens/s, target forward included) of `training.run` for eagle3 and
   dflash, and one EAGLE-3 training step of ours against vLLM's `speculators` on the same random
   hidden states where it is installed (scripts/speculators_step.py);
3. a head trained for a few minutes, then `serving.bench` on MT-bench / HumanEval / GSM8K, chain and
   tree, greedy; the head is kept in OUT/head.

`--smoke` runs the same code on a tiny random target with tiny shapes, in seconds, on CPU (Triton
through its interpreter): CI runs it so that this script cannot rot before a GPU comes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

# (name, shapes): greedy and rejection verify over N tree nodes and a V-token vocabulary; KV compaction of
# L accepted rows in a [B, heads, S, D] cache
SHAPES = {
    "gpu": {"greedy": [(1, 8, 49152), (1, 48, 49152), (4, 48, 49152), (1, 48, 262144)],
            "rejection": [(1, 8, 49152), (1, 48, 49152), (4, 48, 49152)],
            "compact": [(1, 3, 4096, 64, 8), (4, 8, 4096, 128, 8), (1, 8, 8192, 128, 48)]},
    "smoke": {"greedy": [(1, 8, 1000)], "rejection": [(1, 8, 1000)], "compact": [(1, 2, 64, 16, 5)]},
}
# the head's serving.bench runs: a chain of 7 and the 48-node tree
BENCHES = {"chain7": ["draft=chain", "steps=7"], "tree": ["draft=tree", "depth=6", "topk=8", "total_tokens=48"]}


def timed(run, device: torch.device, repeats: int) -> float:
    """Median seconds of `run()` over `repeats` runs after a warm-up (CUDA events on a GPU)."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write): the floor's yardstick."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / timed(lambda: target.copy_(source), device, 20)


def kernel_cases(shapes: dict, device: torch.device, generator: torch.Generator):
    """(kernel, shape, triton, reference, bytes the kernel must move, arguments) for every shape."""
    import kernels

    def rand(*shape, dtype=torch.float32):
        return torch.rand(*shape, generator=generator, device=device).to(dtype)

    for B, N, V in shapes["greedy"]:
        logits = torch.randn(B, N, V, generator=generator, device=device).to(torch.bfloat16)
        parents = torch.arange(-1, N - 1, device=device).expand(B, N).contiguous()
        candidates = logits.argmax(-1).roll(1, 1)  # drafts the target agrees with: the longest path
        yield ("greedy_verify", f"B={B} N={N} V={V} bf16", kernels.greedy_verify_triton,
               kernels.greedy_verify_reference, logits.nbytes, (logits, candidates, parents))
    for B, N, V in shapes["rejection"]:
        p, q = torch.softmax(rand(B, N, V) * 8, -1), torch.softmax(rand(B, N, V) * 8, -1)
        parents = torch.arange(-1, N - 1, device=device).expand(B, N).contiguous()
        candidates = torch.multinomial(q.reshape(B * N, V), 1, generator=generator).reshape(B, N)
        yield ("rejection_verify", f"B={B} N={N} V={V} fp32", kernels.rejection_verify_triton,
               kernels.rejection_verify_reference, p.nbytes + q.nbytes,
               (p, q, candidates, parents, rand(B, N), rand(B, N)))
    for B, H, S, D, L in shapes["compact"]:
        cache = torch.randn(B, H, S, D, generator=generator, device=device).to(torch.bfloat16)
        start = torch.full((B,), S // 2, device=device)
        src = (start[:, None] + 2 * torch.arange(L, device=device)).contiguous()  # every other slot accepted
        lengths = torch.full((B,), L, device=device)
        yield ("compact_kv", f"B={B} H={H} S={S} D={D} L={L} bf16", kernels.compact_kv_triton,
               kernels.compact_kv_reference, 2 * B * H * L * D * cache.element_size(), (cache, src, start, lengths))


def check_kernels(smoke: bool, device: torch.device, repeats: int, bandwidth: float) -> list[dict]:
    """Every kernel case; `bandwidth`: bytes per second of a copy, the floor's yardstick."""
    generator = torch.Generator(device).manual_seed(0)
    rows = []
    for name, shape, triton, reference, moved, args in kernel_cases(SHAPES["smoke" if smoke else "gpu"], device, generator):
        if name == "compact_kv":  # in place: each implementation on its own copy of the cache
            outputs = []
            for run in (triton, reference):
                cache = args[0].clone()
                run(cache, *args[1:])
                outputs.append((cache,))
            seconds = {label: timed(lambda run=run: run(args[0].clone(), *args[1:]), device, repeats)
                       - timed(lambda: args[0].clone(), device, repeats) for label, run in (("triton", triton), ("torch", reference))}
        else:
            outputs = [run(*args) for run in (triton, reference)]
            seconds = {label: timed(lambda run=run: run(*args), device, repeats)
                       for label, run in (("triton", triton), ("torch", reference))}
        identical = all(torch.equal(a, b) for a, b in zip(*outputs))
        floor = moved / bandwidth
        rows.append({"kernel": name, "shape": shape, "identical": identical, "triton_us": seconds["triton"] * 1e6,
                     "torch_us": seconds["torch"] * 1e6, "speedup": seconds["torch"] / max(seconds["triton"], 1e-9),
                     "floor_us": floor * 1e6, "over_floor": seconds["triton"] / floor})
        print(f"  {name} {shape}: identical={identical} triton {seconds['triton'] * 1e6:.1f} us, torch "
              f"{seconds['torch'] * 1e6:.1f} us, floor {floor * 1e6:.1f} us", flush=True)
    return rows


def module(args: list[str], log: str, timeout: float) -> None:
    """`python -m ...` with its output in `log`; a failure stops the check with the log's tail."""
    with open(log, "w") as handle:
        result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                timeout=timeout)
    if result.returncode:
        with open(log) as handle:
            tail = handle.read()[-3000:]
        raise SystemExit(f"device check: {' '.join(args[:2])} failed (exit {result.returncode}); {log}:\n{tail}")


def train(out: str, name: str, overrides: list[str], timeout: float) -> dict:
    """A training run in OUT/<name>: its last eval and its tokens/s (median of the logged windows
    after the first, which holds the warm-up)."""
    run_dir = os.path.join(out, name)
    began = time.perf_counter()
    module(["training.run", "logger=none", f"hydra.run.dir={run_dir}", *overrides], f"{run_dir}.log", timeout)
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    speeds = [r["perf/tokens_per_s"] for r in records if "perf/tokens_per_s" in r]
    evals = [r for r in records if "eval/sim_accept_len" in r]
    return {"tokens_per_s": statistics.median(speeds[1:] or speeds), "steps": max(r["step"] for r in records),
            "sim_accept_len": evals[-1]["eval/sim_accept_len"], "wall_s": time.perf_counter() - began}


def speculators_step(device: torch.device, smoke: bool) -> dict:
    try:
        import speculators  # noqa: F401
    except ImportError:
        return {"skipped": "speculators is not installed (pip install --no-deps speculators==0.9.0)"}
    import speculators_step as step  # beside this script, on sys.path as its folder

    tokens = 256 if smoke else 8192
    steps = {"specdraft": step.ours(tokens, 4, device), "speculators": step.theirs(tokens, 4, device)}
    seconds = {name: timed(run, device, 2 if smoke else 10) for name, run in steps.items()}
    return {"tokens": tokens, **{f"{name}_tokens_per_s": tokens / s for name, s in seconds.items()},
            "specdraft_over_speculators": seconds["speculators"] / seconds["specdraft"]}


def bench(out: str, artifact: str, name: str, options: list[str], smoke: bool, new_tokens: int, timeout: float) -> dict:
    path = os.path.join(out, f"bench-{name}.json")
    size = ["n=1", "max_new_tokens=8"] if smoke else ["n=20", f"max_new_tokens={new_tokens}"]
    module(["serving.bench", f"artifact={artifact}", "prompts=[mtbench,humaneval,gsm8k]", *size, *options,
            f"out={path}", "overwrite=true"], os.path.join(out, f"bench-{name}.log"), timeout)
    with open(path) as handle:
        results = json.load(handle)
    return {"options": options, "dtype": results["config"]["dtype"],
            "sets": {s: {k: r[k] for k in ("accept_len", "speedup", "tokens_per_s_spec", "tokens_per_s_plain",
                                         "identical", "unexplained_divergences")}
                     for s, r in results["datasets"].items()}}


def summary(report: dict) -> str:
    lines = [f"# Device check ({report['mode']}, {report['started']})", "",
             f"{report['device']['name']}; torch {report['device']['torch']}; {report['device'].get('copy_GBps', 0):.0f} GB/s copy", ""]
    if "kernels" in report:
        lines += ["| kernel | shape | identical | Triton us | torch us | speed-up | floor us | Triton / floor |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['shape']} | {r['identical']} | {r['triton_us']:.1f} | {r['torch_us']:.1f} | "
                  f"{r['speedup']:.1f}x | {r['floor_us']:.1f} | {r['over_floor']:.1f}x |" for r in report["kernels"]]
    for name, run in report.get("training", {}).items():
        lines += ["", f"training {name}: " + json.dumps(run)]
    for name, run in report.get("bench", {}).items():
        lines += ["", f"bench {name} ({' '.join(run['options'])}, {run['dtype']}):", "",
                  "| set | accept_len | speed-up | spec tok/s | plain tok/s | identical | unexplained |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {s} | {r['accept_len']:.2f} | {r['speedup']:.2f}x | {r['tokens_per_s_spec']:.1f} | "
                  f"{r['tokens_per_s_plain']:.1f} | {r['identical']} | {r['unexplained_divergences']} |" for s, r in run["sets"].items()]
    lines += ["", "seconds per part: " + json.dumps({k: round(v) for k, v in report["seconds"].items()})]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="directory for device_check.json, device_check.md, the runs and the head")
    parser.add_argument("--smoke", action="store_true", help="tiny target and shapes, on CPU, in seconds (CI)")
    parser.add_argument("--head-minutes", type=float, default=4.0, help="training budget of the head")
    parser.add_argument("--parts", default="kernels,training,head", help="which parts to run, comma-separated")
    parser.add_argument("--data", help="training conversations (data.path=...); default: the ShareGPT wheel")
    parser.add_argument("--benches", default="chain7,tree", help="the head's benches, in order: chain7, tree or both")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens each bench prompt generates")
    args = parser.parse_args()
    if set(args.benches.split(",")) - set(BENCHES):
        parser.error(f"--benches {args.benches}: each must be one of {', '.join(BENCHES)}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("device check: no GPU here (torch.cuda.is_available() is False); on CPU pass --smoke")
    report = {"mode": "smoke" if args.smoke else "gpu", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": {},
              "device": {"name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                         "torch": torch.__version__}}

    def save():
        for name, text in (("device_check.json", json.dumps(report, indent=1)), ("device_check.md", summary(report))):
            with open(os.path.join(args.out, name), "w") as handle:
                handle.write(text)

    target = ["target=tiny_llama", "data.max_samples=40", "data.max_length=128"] if args.smoke else ["target=llama"]
    target += [f"data.path={os.path.abspath(args.data)}"] if args.data else []
    steps = ["trainer.max_steps=3", "trainer.eval_every=3", "trainer.log_every=1"] if args.smoke else \
        ["trainer.max_steps=60", "trainer.eval_every=60", "trainer.log_every=10", "trainer.eval_max_samples=16"]
    parts = args.parts.split(",")
    if "kernels" in parts:
        began = time.perf_counter()
        print("kernels", flush=True)
        bandwidth = copy_bandwidth(device, 8 if args.smoke else 2048)
        report["device"]["copy_GBps"] = bandwidth / 1e9
        report["kernels"] = check_kernels(args.smoke, device, 5 if args.smoke else 100, bandwidth)
        report["seconds"]["kernels"] = time.perf_counter() - began
        save()
    if "training" in parts:
        began = time.perf_counter()
        report["training"] = {}
        for drafter in ("eagle3", "dflash"):
            print(f"training throughput: {drafter}", flush=True)
            report["training"][drafter] = train(args.out, f"throughput-{drafter}", [f"drafter={drafter}", *target, *steps],
                                                600)
            save()
        report["training"]["speculators_step"] = speculators_step(device, args.smoke)
        report["seconds"]["training"] = time.perf_counter() - began
        save()
    if "head" in parts:
        began = time.perf_counter()
        print("head: " + ("2 steps" if args.smoke else f"{args.head_minutes} min") + " of training, then serving.bench", flush=True)
        budget = ["trainer.max_steps=2", "trainer.eval_every=2"] if args.smoke else [
            f"trainer.max_minutes={args.head_minutes}", "trainer.max_steps=100000", "trainer.batch_size=16",
            "trainer.eval_every=1000", "trainer.save_every=1000", "trainer.keep_last=1", "data.max_samples=20000"]
        report["training"] = {**report.get("training", {}),
                              "head": train(args.out, "head", ["drafter=eagle3", *target, *budget], 60 * (args.head_minutes + 10))}
        head = os.path.join(args.out, "head", "checkpoints", "latest")
        report["bench"] = {}
        for name in args.benches.split(","):
            report["bench"][name] = bench(args.out, head, name, BENCHES[name], args.smoke, args.max_new_tokens, 900)
            save()
        report["seconds"]["head"] = time.perf_counter() - began
    save()
    print(summary(report))


if __name__ == "__main__":
    main()
