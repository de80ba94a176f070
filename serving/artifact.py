"""Load a drafter for serving: the one place that turns a drafter on disk into (target, drafter).

An artifact is a training checkpoint (`<run>/checkpoints/step-N` or `latest`) or a native artifact
(`python -m export.run ... format=native`); drafters/artifact.py reads both. Heads in other
engines' formats are imported to native first (`export.run checkpoint=<their dir> format=native`).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from drafters import precision
from drafters.artifact import read
from drafters.target import Target, load_target


def load(path: str, target: Target | None = None, dtype: str = "auto"):
    """(target, drafter) ready to generate, the target computing in `dtype` (auto: the precision
    native to this machine, whatever the head was trained in); refuses an artifact made for
    another target."""
    saved = read(path)
    if target is None:
        target_cfg = OmegaConf.create(saved.target)
        target_cfg.dtype = precision.canonical(dtype, key="dtype")
        target = load_target(target_cfg)
    saved.check_target(target.spec, path)
    return target, saved.build(path).to(target.embed_weight.dtype).eval()  # the drafter runs in the target's dtype
