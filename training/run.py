"""`python -m training.run drafter=eagle3 target=llama [overrides]`: train a draft head."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from drafters.config.command import command
from drafters.storage.writes import owned

log = logging.getLogger("training")


@command("train")
def main(cfg: DictConfig) -> None:
    from training import settings
    from training.trainer import train  # heavy imports after Hydra has parsed the command line

    settings.check(cfg)
    run_dir = HydraConfig.get().runtime.output_dir
    with owned(run_dir, "hydra.run.dir") if os.environ.get("RANK", "0") == "0" else nullcontext():  # one owner per run
        result = train(cfg, run_dir)
    log.info("outputs: %s (metrics.jsonl, plots/, checkpoints/latest)", os.path.abspath(run_dir))
    log.info("final eval/sim_accept_len: %.3f", result["eval/sim_accept_len"])
    log.info("serve it: python -m serving.run artifact=%s prompt=\"...\"",
             os.path.join(os.path.abspath(run_dir), "checkpoints", "latest"))


if __name__ == "__main__":
    main()
