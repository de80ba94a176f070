"""Atomic training checkpoints: write to a temp dir, fsync, rename; `latest` moves last."""

from __future__ import annotations

import json
import os
import shutil

from accelerate.utils import DistributedType

from drafters.artifact import STATE_FILE, fsync_tree
from drafters.errors import UserError


def save(accelerator, model, checkpoints_dir: str, step: int, state: dict, keep_last: int) -> str:
    """Model, optimizer, scheduler, RNG (through Accelerate) + `trainer_state.json`; returns the dir.
    Under DeepSpeed and FSDP, whose own formats are sharded per process, the whole weights are
    also gathered into `model.safetensors`, where resume-free readers (export, serving) look."""
    final = os.path.join(checkpoints_dir, f"step-{step}")
    partial = os.path.join(checkpoints_dir, f".partial-step-{step}")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed mid-write
        os.makedirs(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(partial)
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        accelerator.save_model(model, partial)  # collective: every process takes part
    if accelerator.is_main_process:
        with open(os.path.join(partial, STATE_FILE), "w") as handle:
            json.dump({**state, "step": step}, handle, indent=1)
        fsync_tree(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        link = os.path.join(checkpoints_dir, ".latest-tmp")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(f"step-{step}", link)
        os.replace(link, os.path.join(checkpoints_dir, "latest"))
        _prune(checkpoints_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def _prune(checkpoints_dir: str, keep_last: int) -> None:
    steps = sorted(
        int(name.split("-")[1]) for name in os.listdir(checkpoints_dir) if name.startswith("step-")
    )
    for step in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(checkpoints_dir, f"step-{step}"))


def find(resume: str, checkpoints_dir: str) -> str | None:
    """The checkpoint to resume from: `no` -> None, `auto` -> latest if any, else a given dir."""
    if resume in (None, "no", False):
        return None
    if resume == "auto":
        latest = os.path.join(checkpoints_dir, "latest")
        return os.path.realpath(latest) if os.path.exists(latest) else None
    if not os.path.isfile(os.path.join(str(resume), STATE_FILE)):
        raise UserError(f"trainer.resume: {resume} is not a training checkpoint (no {STATE_FILE})")
    return str(resume)


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as handle:
        return json.load(handle)


def check_compatible(path: str, state: dict, expected: dict) -> None:
    """Refuse to resume a checkpoint made for another drafter, target or draft vocabulary."""
    for field in ("drafter", "target", "target_fingerprint", "vocab_key"):
        if state.get(field) != expected[field]:
            raise UserError(
                f"cannot resume from {path}: it was trained with {field}={state.get(field)!r}, "
                f"this run has {field}={expected[field]!r}"
            )
