"""How few-row products and target forwards cost on this CPU, in float32 (docs/serving.md: "Some
row counts are slow"): SmolLM2's products for each row count as they are and zero-padded to
`fast_rows`, then whole target forwards after a 128-token context with `project` as it is and
unpadded. Interleaved in a shuffled order, medians.

    python scripts/few_rows.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import drafters.target.model as model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_cases(cases: list, run, repeats: int) -> dict:
    """Median seconds of `run(case)` per case, the cases shuffled anew in each round."""
    times = {case: [] for case in cases}
    for _ in range(repeats):
        random.shuffle(cases)
        for case in cases:
            began = time.perf_counter()
            run(case)
            times[case].append(time.perf_counter() - began)
    return {case: statistics.median(seconds) for case, seconds in times.items()}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    random.seed(0)
    target = model.load_target(OmegaConf.load(os.path.join(ROOT, "conf", "target", "llama.yaml")), "cpu")
    weights = [module.weight for module in target.model.modules() if isinstance(module, torch.nn.Linear)]
    counts = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 15, 16, 17, 28, 32]

    def products(case):
        rows, _ = case
        inputs = {width: torch.randn(rows, width) for width in {w.shape[1] for w in weights}}
        for weight in weights:
            weight @ inputs[weight.shape[1]].T

    cases = sorted({(n, n) for n in counts} | {(model.fast_rows(n), n) for n in counts}, key=lambda case: case[::-1])
    seconds = timed_cases([*cases], products, args.repeats)
    print(f"products of {len(weights)} weights, ms: rows as they are | padded to fast_rows")
    for n in counts:
        print(f"{n:3d} | {1000 * seconds[(n, n)]:6.1f} | {model.fast_rows(n)}: {1000 * seconds[(model.fast_rows(n), n)]:6.1f}")

    cache = DynamicCache()
    target.capture(torch.ones(1, 128, dtype=torch.long), None, [], cache=cache)
    fast = model.fast_rows

    def forward(case):
        tokens, padded = case
        model.fast_rows = fast if padded else (lambda rows: rows)
        _, final = target.capture(torch.ones(1, tokens, dtype=torch.long), None, [], cache=cache,
                                  position_ids=torch.arange(128, 128 + tokens)[None])
        target.logits(final)
        cache.crop(-tokens)

    tokens = [1, 2, 3, 7, 11, 15]
    seconds = timed_cases([(n, padded) for n in tokens for padded in (False, True)], forward, args.repeats)
    model.fast_rows = fast
    print("target forwards after 128 tokens, ms: unpadded | padded")
    for n in tokens:
        print(f"{n:3d} | {1000 * seconds[(n, False)]:6.1f} | {1000 * seconds[(n, True)]:6.1f} | "
              f"{seconds[(n, False)] / seconds[(n, True)]:.2f}x")


if __name__ == "__main__":
    main()
