"""`python -m training.dump <the training run's overrides>`: run the frozen target once over the
data and write the hidden-state cache (training/hidden_cache.py) that `data.hidden_states=offline`
then trains from, for as many runs and epochs as wanted.

Resumable: each shard is written to a temp file, fsynced and renamed, so it is complete or
absent; a restarted dump skips complete shards and never rewrites them. Data-parallel: started
with N processes (`python -m training.launch launch.module=training.dump ...`), process r writes
shards r, r + N, ... of each split, and the main process marks the index complete at the end.
"""

from __future__ import annotations

from omegaconf import DictConfig

from drafters.config.command import command
from training import settings
from training.trainer import dump


@command("train")
def main(cfg: DictConfig) -> None:
    settings.check(cfg)
    dump(cfg)


if __name__ == "__main__":
    main()
