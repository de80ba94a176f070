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
import os
import tempfile

import torch
from accelerate import PartialState
from omegaconf import DictConfig
from safetensors import safe_open
from safetensors.torch import save_file

from drafters.config.errors import UserError, command
from drafters.storage.writes import atomic_file, check_creatable, check_destination, remove_stale_partials
from drafters.target import precision
from drafters.target.model import load_target
from training import distributed, hidden_cache, settings
from training.trainer import build_model, make_batch, prepare_data

log = logging.getLogger("training")


@command("train")
def main(cfg: DictConfig) -> None:
    settings.check(cfg)
    dump(cfg)


def dump(cfg: DictConfig) -> dict:
    """Write this process's missing shards of `data.cache.dir`; returns how many it wrote and
    skipped, and on the main process the finished cache's stats."""
    check_destination(str(cfg.data.cache.dir), key="data.cache.dir")  # before the target loads
    check_cache_dir(str(cfg.data.cache.dir))
    device, world = distributed.platform(), distributed.world_size()
    state = PartialState(cpu=device == "cpu", **({"backend": "gloo"} if device == "cpu" and world > 1 else {}))
    target = load_target(cfg.target, state.device)
    chosen = precision.resolve(cfg.target.get("dtype", "auto"), state.device)
    log.info("precision: %s for the target; %s", chosen.describe(), chosen.hardware.describe())
    with distributed.main_process_first(state):  # the main process writes the data caches, the others read them
        train_set, eval_set = prepare_data(cfg, target)
    with tempfile.TemporaryDirectory() as scratch:  # the drafter is built only to learn its capture layers
        layers = build_model(cfg, target, train_set, scratch)[0].capture_layers()
    # the shard size is part of what a resumed dump must agree on, not of what training checks
    expected = {**hidden_cache.identity(cfg, target, layers, train_set, eval_set),
                "shard_sequences": int(cfg.data.cache.shard_sequences)}
    directory = str(cfg.data.cache.dir)
    if state.is_main_process:
        begin(directory, expected)
    state.wait_for_everyone()

    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    written = skipped = 0
    for split, dataset in (("train", train_set), ("eval", eval_set)):
        shards = hidden_cache.shard_count(len(dataset), expected["shard_sequences"])
        for shard in range(state.process_index, shards, state.num_processes):
            path = hidden_cache.shard_path(directory, split, shard)
            if os.path.exists(path):
                skipped += 1
                continue
            write_shard(target, layers, dataset, shard, cfg.data.cache, pad_id, path)
            written += 1
            log.info("dump: wrote %s", os.path.basename(path))
    log.info("dump process %d: wrote %d shards, skipped %d complete ones", state.process_index, written, skipped)
    state.wait_for_everyone()
    stats = finish(directory, expected) if state.is_main_process else None
    if stats:
        log.info("dump complete in %s: %s", directory, stats)
    return {"written": written, "skipped": skipped, "cache": stats}


def check_cache_dir(directory: str) -> None:
    """A cache goes into a directory of its own: one that holds no cache yet must be new or empty."""
    check_creatable(directory, "data.cache.dir")
    if not os.path.isdir(directory) or hidden_cache.read_index(directory) is not None:
        return
    others = sorted(name for name in os.listdir(directory) if not name.startswith("."))
    if others:
        raise UserError(f"data.cache.dir {directory} holds other files ({', '.join(others[:3])}"
                        f"{', ...' if len(others) > 3 else ''}): give a new or empty directory")


def begin(directory: str, expected: dict) -> None:
    """Start or continue a dump: a cache made for anything else is refused, never mixed in."""
    os.makedirs(directory, exist_ok=True)
    stored = hidden_cache.read_index(directory)
    if stored is None:
        hidden_cache.write_index(directory, {**expected, "complete": False})
    else:
        hidden_cache.check_identity(directory, stored, expected)
    remove_stale_partials(directory, every_name=True)  # shards a killed writer left half-written


def write_shard(target, layers, dataset, shard: int, cache_cfg: DictConfig, pad_id: int, path: str) -> None:
    per_shard, dtype = int(cache_cfg.shard_sequences), str(cache_cfg.dtype)
    first = shard * per_shard
    indices = list(range(first, min(first + per_shard, len(dataset))))
    parts: dict[str, list] = {"aux": [], "final": [], "aux_scale": [], "final_scale": []}
    lengths: dict[str, list] = {"aux": [], "final": []}
    for start in range(0, len(indices), int(cache_cfg.batch_size)):
        batch = make_batch(dataset, indices[start : start + int(cache_cfg.batch_size)], pad_id, target.device)
        aux, final = target.capture(batch["input_ids"], batch["attention_mask"], layers)
        aux = torch.stack(aux, 2)  # [B, T, layers, H]
        for row in range(len(aux)):
            tokens = int(batch["attention_mask"][row].sum())
            positions = hidden_cache.teacher_positions(batch["loss_mask"][row, :tokens])
            for name, vectors in (("aux", aux[row, :tokens]), ("final", final[row, positions])):
                values, scale = hidden_cache.encode(vectors, dtype)  # on the target's device
                parts[name].append(values.cpu())
                if scale is not None:
                    parts[f"{name}_scale"].append(scale.cpu())
                lengths[name].append(len(values))
    tensors = {name: torch.cat(chunks) for name, chunks in parts.items() if chunks}
    for name, counts in lengths.items():
        tensors[f"{name}_offsets"] = torch.tensor([0, *counts]).cumsum(0)
    with atomic_file(path, key="data.cache.dir") as partial:  # complete or absent: what a restart relies on
        save_file(tensors, partial, metadata={"first_sequence": str(first), "sequences": str(len(indices))})


def finish(directory: str, expected: dict) -> dict:
    """Check every shard is there, then mark the index complete with the cache's size."""
    shards = hidden_cache.all_shards(directory, expected)
    missing = [path for path in shards if not os.path.exists(path)]
    if missing:
        raise UserError(f"dump of {directory} is missing {len(missing)} shards (e.g. {missing[0]}): run it again")
    tokens = teacher = 0
    for path in shards:
        with safe_open(path, framework="pt") as handle:
            tokens += int(handle.get_tensor("aux_offsets")[-1])
            teacher += int(handle.get_tensor("final_offsets")[-1])
    size = sum(os.path.getsize(path) for path in shards)
    # speculators stores [T, layers + 1, H] in bf16 for every token: the aux layers and the final state
    speculators = (len(expected["layers"]) + 1) * expected["hidden_size"] * 2
    stats = {"tokens": tokens, "teacher_positions": teacher, "bytes": size, "bytes_per_token": round(size / tokens, 1),
             "speculators_bytes_per_token": speculators, "ratio_to_speculators": round(size / tokens / speculators, 3)}
    hidden_cache.write_index(directory, {**expected, "complete": True, "stats": stats})
    return stats


if __name__ == "__main__":
    main()
