"""Atomic training checkpoints (drafters/storage/writes.py): write to a temp dir, fsync, rename; `latest`
moves last."""

from __future__ import annotations

import json
import os
import pickle
import shutil

from accelerate.utils import DistributedType, broadcast_object_list
from safetensors import SafetensorError

from drafters.config.errors import UserError
from drafters.storage.artifact import TrainingState
from drafters.storage.writes import STATE_FILE, commit_directory, remove_stale_partials, seal, temp_beside
from training.schedule import optimizer_name


def save(accelerator, model, checkpoints_dir: str, state: TrainingState, keep_last: int) -> str:
    """Model, optimizer, scheduler, RNG (through Accelerate) + `trainer_state.json`; returns the dir.
    Under DeepSpeed and FSDP, whose own formats are sharded per process, the whole weights are
    also gathered into `model.safetensors`, where resume-free readers (export, serving) look."""
    step = state.step
    final = os.path.join(checkpoints_dir, f"step-{step}")
    partial = [temp_beside(final) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(partial)  # every process writes its part into the main process's temp dir
    partial = partial[0]
    if accelerator.is_main_process:
        remove_stale_partials(checkpoints_dir, every_name=True)  # what a run killed mid-write left
        os.makedirs(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(partial)
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        accelerator.save_model(model, partial)  # collective: every process takes part
    if accelerator.is_main_process:
        state.write(partial)
        seal(partial)
        commit_directory(partial, final)  # a step resumed from an earlier checkpoint is replaced whole
        latest = os.path.join(checkpoints_dir, "latest")
        link = temp_beside(latest)
        os.symlink(f"step-{step}", link)
        os.replace(link, latest)
        _prune(checkpoints_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def _prune(checkpoints_dir: str, keep_last: int) -> None:
    steps = sorted(
        int(name.split("-")[1]) for name in os.listdir(checkpoints_dir) if name.startswith("step-")
    )
    for step in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(checkpoints_dir, f"step-{step}"))


def find(resume: str, checkpoints_dir: str, max_steps: int) -> tuple[str, TrainingState] | None:
    """The checkpoint to resume from and its state: `no` -> None, `auto` -> latest if any, else a
    given dir. Refused before any work: a run dir whose checkpoints `no` would overwrite, a
    checkpoint that is not one or is already at `max_steps`."""
    if resume in (None, "no", False):
        existing = sorted(name for name in os.listdir(checkpoints_dir) if name.startswith("step-")) \
            if os.path.isdir(checkpoints_dir) else []
        if existing:
            raise UserError(f"trainer.resume=no: {checkpoints_dir} already holds checkpoints ({', '.join(existing)}); "
                            "pass trainer.resume=auto to continue them, or choose another hydra.run.dir")
        return None
    if resume == "auto":
        latest = os.path.join(checkpoints_dir, "latest")
        if not os.path.exists(latest):
            return None
        path = os.path.realpath(latest)
    else:
        path = str(resume)
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise UserError(f"trainer.resume: {path} is not a training checkpoint (no {STATE_FILE})")
    state = read_state(path)
    if state.step >= max_steps:
        raise UserError(f"trainer.resume: {path} is already at step {state.step} and trainer.max_steps={max_steps}: "
                        f"nothing left to train (raise trainer.max_steps to train on)")
    return path, state


def load(accelerator, path: str) -> None:
    """Model, optimizer, scheduler and RNG states back from `path`, or one line saying which
    checkpoint is unreadable (a truncated or corrupt file)."""
    try:
        accelerator.load_state(path)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError, SafetensorError) as error:
        raise UserError(f"cannot resume from {path}: its saved state is unreadable "
                        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'truncated'})") from None


def read_state(path: str) -> TrainingState:
    """A checkpoint's trainer_state.json, or a one-line UserError naming what is wrong with it."""
    where = os.path.join(path, STATE_FILE)
    try:
        with open(where) as handle:
            return TrainingState.parse(json.load(handle), where)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"checkpoint {where} is unreadable ({str(error).splitlines()[0]})") from None


def check_compatible(path: str, state: TrainingState, expected: dict) -> None:
    """Refuse to resume a checkpoint made for another drafter, target, draft vocabulary or optimizer."""
    saved = {field: getattr(state, field) for field in ("drafter", "target", "target_fingerprint", "vocab_key")}
    saved["trainer.optimizer"] = optimizer_name(state.config)
    for field, value in saved.items():
        if value != expected[field]:
            raise UserError(f"cannot resume from {path}: it was trained with {field}={value!r}, "
                            f"this run has {field}={expected[field]!r}")
