"""`python -m training.dump <the training run's overrides>`: run the frozen target once over the
data and write the hidden-state cache (training/hidden_cache.py) that `data.hidden_states=offline`
then trains from, for as many runs and epochs as wanted.

Resumable: each shard is written to a temp file, fsynced and renamed, so it is complete or
absent; a restarted dump skips complete shards and never rewrites them. Data-parallel: started
with N processes (`python -m training.launch launch.module=training.dump ...`), process r writes
shards r, r + N, ... of each split, and the main process marks the index complete at the end.
"""

from __future__ import annotations

import logging
import tempfile

from accelerate import PartialState
from omegaconf import DictConfig

from drafters.config.errors import command
from drafters.target import precision
from drafters.target.model import load_target
from training import distributed, hidden_cache, settings
from training.trainer import build_model, prepare_data

log = logging.getLogger("training")


@command("train")
def main(cfg: DictConfig) -> None:
    settings.check(cfg)
    dump(cfg)


def dump(cfg: DictConfig) -> dict:
    """Write this process's missing shards of `data.cache.dir`; returns how many it wrote and
    skipped, and on the main process the finished cache's stats."""
    hidden_cache.check_destination(str(cfg.data.cache.dir))  # before the target loads
    device, world = distributed.platform(), distributed.world_size()
    state = PartialState(cpu=device == "cpu", **({"backend": "gloo"} if device == "cpu" and world > 1 else {}))
    target = load_target(cfg.target, state.device)
    chosen = precision.resolve(cfg.target.get("dtype", "auto"), state.device)
    log.info("precision: %s for the target; %s", chosen.describe(), chosen.hardware.describe())
    with distributed.main_process_first(state):  # the main process writes the data caches, the others read them
        train_set, eval_set = prepare_data(cfg, target)
    with tempfile.TemporaryDirectory() as scratch:  # the drafter is built only to learn its capture layers
        layers = build_model(cfg, target, train_set, scratch)[0].capture_layers()
    return hidden_cache.write(cfg, target, layers, train_set, eval_set, state)


if __name__ == "__main__":
    main()
