"""Load a drafter for serving: the one place that knows what an artifact looks like.

Today an artifact is a training checkpoint (`<run>/checkpoints/step-N` or `latest`): weights in
`model.safetensors` (with `d2t`/`t2d`) and `trainer_state.json` (drafter config, target config and
spec). The export issue adds self-describing artifact formats behind this same function.
"""

from __future__ import annotations

import json
import os

from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file

from drafters.base import drafter_class
from drafters.errors import UserError
from drafters.target import Target, load_target
from drafters.vocab import DraftVocab


def read(path: str) -> tuple[dict, dict]:
    """(trainer state, weights) of an artifact dir, or a one-line UserError."""
    state_file, weights_file = os.path.join(path, "trainer_state.json"), os.path.join(path, "model.safetensors")
    if not os.path.isdir(path):
        raise UserError(f"artifact not found: {path}")
    for required in (state_file, weights_file):
        if not os.path.isfile(required):
            raise UserError(f"artifact {path} is incomplete: missing {os.path.basename(required)}")
    try:
        with open(state_file) as handle:
            state = json.load(handle)
        return state, load_file(weights_file)
    except (json.JSONDecodeError, OSError, SafetensorError) as error:
        raise UserError(f"artifact {path} is unreadable ({str(error).splitlines()[0]})") from None


def load(path: str, target: Target | None = None, dtype: str | None = None):
    """(target, drafter) ready to generate; refuses an artifact made for another target."""
    state, weights = read(path)
    config = OmegaConf.create(state["config"])
    if dtype:
        config.target.dtype = dtype
    if target is None:
        target = load_target(config.target)
    expected = state["target_spec"]
    for field in ("vocab_size", "hidden_size", "num_layers"):
        if expected[field] != getattr(target.spec, field):
            raise UserError(
                f"artifact {path} was trained for target {expected['name']} ({field}={expected[field]}), "
                f"the loaded target {target.spec.name} has {field}={getattr(target.spec, field)}"
            )
    vocab = DraftVocab(d2t=weights["d2t"], t2d=weights["t2d"], key={})
    drafter = drafter_class(state["drafter"])(config.drafter, target.spec, vocab)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UserError(f"artifact {path}: missing weights {missing}, unexpected weights {unexpected}")
    return target, drafter.to(target.embed_weight.dtype).eval()  # the drafter runs in the target's dtype
