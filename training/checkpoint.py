"""Atomic training checkpoints (drafters/storage/writes.py): write to a temp dir, fsync, rename; `latest`
moves last."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil

from accelerate.utils import DistributedType, broadcast_object_list
from safetensors import SafetensorError

from drafters.config.errors import UserError
from drafters.storage.artifact import TrainingState
from drafters.storage.writes import (STATE_FILE, commit_directory, no_space, out_of_space, remove_stale_partials, seal,
                                     temp_beside)
from training.schedule import optimizer_name

log = logging.getLogger("training")
STEP_DIR = re.compile(r"step-(\d+)")  # what save names a checkpoint; anything else in checkpoints/ is not ours


def save(accelerator, model, checkpoints_dir: str, state: TrainingState, keep_last: int) -> str:
    """Model, optimizer, scheduler, RNG (through Accelerate) + `trainer_state.json`; returns the dir.
    Under DeepSpeed and FSDP, whose own formats are sharded per process, the whole weights are
    also gathered into `model.safetensors`, where resume-free readers (export, serving) look.
    A save that fails (a full disk) removes what it wrote and leaves `latest` where it was."""
    step = state.step
    final = os.path.join(checkpoints_dir, f"step-{step}")
    if os.path.lexists(final) and not os.path.isfile(os.path.join(final, STATE_FILE)):
        raise UserError(f"cannot write checkpoint {final}: something that is not a checkpoint is there; move it away "
                        "and rerun with trainer.resume=auto")
    partial = [temp_beside(final) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(partial)  # every process writes its part into the main process's temp dir
    partial = partial[0]
    if accelerator.is_main_process:
        remove_stale_partials(checkpoints_dir, every_name=True)  # what a run killed mid-write left
        os.makedirs(partial)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(partial)
        if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            accelerator.save_model(model, partial)  # collective: every process takes part
        if accelerator.is_main_process:
            state.write(partial)
            seal(partial)
    except Exception as error:
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        if not out_of_space(error):
            raise
        latest = os.path.join(checkpoints_dir, "latest")
        raise no_space("cannot write checkpoint", final, f"the last checkpoint, {os.path.realpath(latest)}, is intact: "
                       "free some space and rerun with trainer.resume=auto" if os.path.exists(latest)
                       else "no checkpoint was kept") from None
    if accelerator.is_main_process:
        commit_directory(partial, final)  # a step resumed from an earlier checkpoint is replaced whole
        latest = os.path.join(checkpoints_dir, "latest")
        link = temp_beside(latest)
        os.symlink(f"step-{step}", link)
        os.replace(link, latest)
        _prune(checkpoints_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def steps_held(checkpoints_dir: str) -> list[int]:
    """The steps of the complete checkpoints in `checkpoints_dir`, ascending; other entries are not ours."""
    if not os.path.isdir(checkpoints_dir):
        return []
    return sorted(int(found[1]) for name in os.listdir(checkpoints_dir) if (found := STEP_DIR.fullmatch(name))
                  and os.path.isfile(os.path.join(checkpoints_dir, name, STATE_FILE)))


def _prune(checkpoints_dir: str, keep_last: int) -> None:
    steps = steps_held(checkpoints_dir)
    for step in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(checkpoints_dir, f"step-{step}"))


def find(resume: str, checkpoints_dir: str, max_steps: int) -> tuple[str, TrainingState] | None:
    """The checkpoint to resume from and its state: `no` -> None, `auto` -> `latest`, or the newest
    complete step where `latest` is missing or dangling, else None; else a given dir. Refused before
    any work: a run dir whose checkpoints `no` would overwrite, a checkpoint that is not one or is
    already at `max_steps`."""
    held = steps_held(checkpoints_dir)
    if resume in (None, "no", False):
        named = sorted(name for name in os.listdir(checkpoints_dir) if STEP_DIR.fullmatch(name)) \
            if os.path.isdir(checkpoints_dir) else []  # incomplete ones too: a save would replace them
        if named:
            raise UserError(f"trainer.resume=no: {checkpoints_dir} already holds checkpoints ({', '.join(named)}); "
                            "pass trainer.resume=auto to continue them, or choose another hydra.run.dir")
        return None
    if resume == "auto":
        latest = os.path.join(checkpoints_dir, "latest")
        if os.path.isfile(os.path.join(latest, STATE_FILE)):
            path = os.path.realpath(latest)
        elif held:  # `latest` deleted with a bad checkpoint, or lost in a copy: never restart over the others
            path = os.path.join(checkpoints_dir, f"step-{held[-1]}")
            log.warning("trainer.resume=auto: %s is %s; resuming from the newest checkpoint, %s", latest,
                        "dangling" if os.path.islink(latest) else "missing", path)
        else:
            return None
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
