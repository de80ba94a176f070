"""The offline hidden-state cache: written once by `python -m training.dump`, read back by
training with `data.hidden_states=offline` instead of running the target on every batch.

    <dir>/index.json                       what the cache is for (target, layers, dtype, data hash),
                                           its shard size, and whether every shard is written
    <dir>/<split>-<shard:05d>.safetensors  `shard_sequences` consecutive sequences of a split:
        aux          [tokens, layers, H]   hidden states entering the drafter's layers, every token
        final        [rows, H]             final (normed) hidden state, only at teacher positions
        aux_scale    [tokens, layers]      fp8 only: one fp32 scale per vector
        final_scale  [rows]
        aux_offsets, final_offsets  [sequences + 1]  where each sequence starts

Teacher positions are those whose next token is trained on (loss_mask[t + 1] = 1): the only
places any loss or metric reads the teacher, whose logits are recomputed from `final` through
the target's lm_head. No padding, token ids or logits are stored: the data hash pins the tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache

import torch
from omegaconf import DictConfig
from safetensors import safe_open

from drafters.config.errors import UserError
from drafters.storage.writes import atomic_file

FORMAT, VERSION = "specdraft-hidden-states", 1
INDEX = "index.json"
DTYPES = ("bf16", "fp8")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
SPLITS = ("train", "eval")
# what the less obvious identity fields stand for, in the stale-cache message
MEANING = {"target_fingerprint": "the target's weights", "layers": "the drafter's capture layers",
           "data": "the token ids and loss masks of data.* and seed", "sequences": "conversations per split"}


def teacher_positions(loss_mask) -> torch.Tensor:
    """Positions t whose next token is trained on: where the teacher's prediction is read."""
    return torch.nonzero(torch.as_tensor(loss_mask)[1:]).flatten()


def encode(vectors: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., H] -> stored values and, for fp8, one scale per vector (its max maps to fp8's max)."""
    if dtype == "bf16":
        return vectors.to(torch.bfloat16), None
    scale = vectors.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (vectors.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def decode(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def data_hash(*datasets) -> str:
    """Hash of the token ids and loss masks (Arrow buffers: fast for 100k+ conversations)."""
    digest = hashlib.sha256()
    for dataset in datasets:
        for column in ("input_ids", "loss_mask"):
            values = dataset.data.column(column).combine_chunks()
            digest.update(values.offsets.to_numpy().tobytes())
            digest.update(values.values.to_numpy().tobytes())
    return digest.hexdigest()[:16]


def identity(cfg: DictConfig, target, layers, train_set, eval_set) -> dict:
    """Everything the stored vectors depend on: a cache with any other value is stale."""
    if cfg.data.cache.dtype not in DTYPES:
        raise UserError(f"data.cache.dtype: unknown '{cfg.data.cache.dtype}' ({' | '.join(DTYPES)})")
    return {
        "format": FORMAT,
        "version": VERSION,
        "target": target.spec.name,
        "target_fingerprint": target.fingerprint,
        "layers": [int(k) for k in layers],
        "hidden_size": target.spec.hidden_size,
        "dtype": str(cfg.data.cache.dtype),
        "data": data_hash(train_set, eval_set),
        "sequences": {"train": len(train_set), "eval": len(eval_set)},
    }


def shard_path(directory: str, split: str, shard: int) -> str:
    return os.path.join(directory, f"{split}-{shard:05d}.safetensors")


def shard_count(sequences: int, per_shard: int) -> int:
    return -(-sequences // per_shard)


def all_shards(directory: str, index: dict) -> list[str]:
    per_shard = index["shard_sequences"]
    return [shard_path(directory, split, shard) for split in SPLITS
            for shard in range(shard_count(index["sequences"][split], per_shard))]


def read_index(directory: str) -> dict | None:
    path = os.path.join(directory, INDEX)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"hidden-state cache {path} is unreadable ({error})") from None


def write_index(directory: str, index: dict) -> None:
    with atomic_file(os.path.join(directory, INDEX), key="data.cache.dir") as partial, open(partial, "w") as handle:
        json.dump(index, handle, indent=1)


def check_identity(directory: str, stored: dict, expected: dict) -> None:
    """One line naming the first field on which the cache differs from what this run needs."""
    for field, value in expected.items():
        if stored.get(field) != value:
            meaning = f" ({MEANING[field]})" if field in MEANING else ""
            raise UserError(f"hidden-state cache {directory} is stale: it holds {field}={stored.get(field)!r}{meaning}, "
                            f"this run needs {field}={value!r}; dump again into another data.cache.dir, "
                            "or delete this one")


@lru_cache(maxsize=64)
def _open_shard(path: str):
    """A memory-mapped shard and its offsets; safetensors reads only the slices asked for."""
    handle = safe_open(path, framework="pt")
    return handle, handle.get_tensor("aux_offsets").tolist(), handle.get_tensor("final_offsets").tolist()


class HiddenCache:
    def __init__(self, directory: str, index: dict):
        self.directory, self.index = directory, index
        self.per_shard = index["shard_sequences"]
        self.scaled = index["dtype"] == "fp8"

    @classmethod
    def open(cls, cfg: DictConfig, target, layers, train_set, eval_set) -> "HiddenCache":
        """The cache of `data.cache.dir`, refused unless complete and made for exactly this run."""
        directory = str(cfg.data.cache.dir)
        index = read_index(directory)
        if index is None:
            raise UserError(f"no hidden-state cache in {directory} (data.cache.dir): write it first with "
                            "python -m training.dump <this run's overrides>")
        check_identity(directory, index, identity(cfg, target, layers, train_set, eval_set))
        if not index.get("complete"):
            raise UserError(f"hidden-state cache {directory} is incomplete (its dump was interrupted): run "
                            "python -m training.dump again with the same overrides to finish it")
        return cls(directory, index)

    def _read(self, split: str, index: int, name: str):
        shard, local = divmod(index, self.per_shard)
        handle, aux_offsets, final_offsets = _open_shard(shard_path(self.directory, split, shard))
        offsets = aux_offsets if name == "aux" else final_offsets
        start, end = offsets[local], offsets[local + 1]
        scale = handle.get_slice(f"{name}_scale")[start:end] if self.scaled else None
        return handle.get_slice(name)[start:end], scale

    def hidden(self, split: str, indices: list[int], loss_mask: torch.Tensor, dtype: torch.dtype, device):
        """(aux as a list of [B, T, H], final [B, T, H]) for a right-padded batch, as `Target.capture`
        returns them; zero at padding, and `final` zero away from teacher positions."""
        batch, width = loss_mask.shape
        hidden_size, layers = self.index["hidden_size"], len(self.index["layers"])
        aux = torch.zeros(batch, width, layers, hidden_size, dtype=dtype)
        final = torch.zeros(batch, width, hidden_size, dtype=dtype)
        for row, index in enumerate(indices):
            values, scale = self._read(split, index, "aux")
            aux[row, : len(values)] = decode(values, scale, dtype)
            values, scale = self._read(split, index, "final")
            final[row, teacher_positions(loss_mask[row].cpu())] = decode(values, scale, dtype)
        aux, final = aux.to(device), final.to(device)
        return [aux[:, :, k] for k in range(layers)], final
