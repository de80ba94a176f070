"""Load a drafter for serving: the one place that turns a drafter on disk into (target, drafter).

An artifact is a training checkpoint (`<run>/checkpoints/step-N` or `latest`) or a native artifact
(`python -m export.run ... format=native`); drafters/storage/artifact.py reads both. Heads in other
engines' formats are imported to native first (`export.run checkpoint=<their dir> format=native`).
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from drafters.storage.artifact import read
from drafters.target import precision
from drafters.target.model import Target, load_target


def load(path: str, target: Target | None = None, dtype: str = "auto"):
    """(target, drafter) ready to generate, on the GPU where there is one, the target computing in
    `dtype` (auto: the precision native to that device, whatever the head was trained in); refuses
    an artifact made for another target."""
    saved = read(path)
    if target is None:
        target_cfg = OmegaConf.create(saved.target)
        target_cfg.dtype = precision.canonical(dtype, key="dtype")
        target = load_target(target_cfg, "cuda" if torch.cuda.is_available() else "cpu")  # ROCm's torch says cuda too
    saved.check_target(target.spec, path)
    # the drafter runs where the target runs, in its dtype
    return target, saved.build(path).to(target.embed_weight.device, target.embed_weight.dtype).eval()
