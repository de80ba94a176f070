"""The offline hidden-state cache: written once by `python -m training.dump` (or by a run with
`data.hidden_states=cached`), read back by training with `data.hidden_states=offline` or `cached`
instead of running the target on every batch.

    <dir>/index.json                       what the cache is for (target, layers, dtype, data hash),
                                           its shard size, and whether every shard is written
    <dir>/<split>-<shard:05d>.safetensors  `shard_sequences` consecutive sequences of a split:
        aux          [tokens, layers, H]   hidden states entering the drafter's layers, every token
        final        [rows, H]             final (normed) hidden state, only at teacher positions
        greedy       [rows]                the target's greedy token there (int32)
        aux_scale    [tokens, layers]      fp8 only: one fp32 scale per vector
        final_scale  [rows]
        aux_offsets, final_offsets  [sequences + 1]  where each sequence starts

Teacher positions are those whose next token is trained on (loss_mask[t + 1] = 1): the only
places any loss or metric reads the teacher, whose logits are recomputed from `final` through
the target's lm_head; the greedy tokens spare training the full-vocabulary argmax. No padding,
input ids or logits are stored: the data hash pins the tokens.

Where the data is regenerated, the dump copies most sequences from the states regeneration kept
(`RegenCapture`: `<regenerated answers>.states-<key>/batch-*.safetensors`, the same fields per
batch plus `first_teacher`, found by a hash of each sequence's token ids) instead of running the
target over them again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from drafters.config.errors import UserError
from drafters.storage import writes
from drafters.storage.writes import atomic_file, check_creatable, remove_stale_partials
from training import data

log = logging.getLogger("training")

FORMAT, VERSION = "specdraft-hidden-states", 2  # 2: greedy tokens
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
            index = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"hidden-state cache {path} is unreadable ({error})") from None
    if not isinstance(index, dict):
        raise UserError(f"hidden-state cache {path} is not a cache index (a JSON object)")
    return index


def digest(expected: dict) -> str:
    """What every shard of a cache records of the cache it belongs to (identity and shard size)."""
    return hashlib.sha256(json.dumps(expected, sort_keys=True).encode()).hexdigest()[:16]


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


def check_shard(path: str, first: int, sequences: int, index: dict) -> None:
    """Refuse a shard that is missing, unreadable (cut short), or not this cache's: another shard
    size, another cache (the digest it records), other layers or another hidden size."""
    fix = "delete it and run python -m training.dump again with the same overrides to rewrite it"
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            found = {"first_sequence": metadata.get("first_sequence"), "sequences": metadata.get("sequences"),
                     "aux": handle.get_slice("aux").get_shape()[1:], "aux_offsets": handle.get_slice("aux_offsets").get_shape()}
    except FileNotFoundError:
        raise UserError(f"hidden-state cache shard {path} is missing: run python -m training.dump again with the "
                        "same overrides to write it") from None
    except (SafetensorError, OSError, RuntimeError) as error:
        raise UserError(f"hidden-state cache shard {path} is unreadable ({str(error).splitlines()[0]}): {fix}") from None
    wanted = {"first_sequence": str(first), "sequences": str(sequences), "aux": [len(index["layers"]), index["hidden_size"]],
              "aux_offsets": [sequences + 1]}
    if "cache" in metadata:  # shards written before it was recorded are checked on the rest only
        found["cache"], wanted["cache"] = metadata["cache"], digest({k: v for k, v in index.items() if k not in ("complete", "stats")})
    wrong = [f"{field} {found[field]} (this cache: {wanted[field]})" for field in wanted if found[field] != wanted[field]]
    if wrong:
        raise UserError(f"hidden-state cache shard {path} is not one of this cache's: {', '.join(wrong)}; {fix}")


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
        per_shard = index.get("shard_sequences")
        if not isinstance(per_shard, int) or isinstance(per_shard, bool) or per_shard < 1:
            raise UserError(f"hidden-state cache {directory}: {INDEX} has no shard_sequences (a positive integer)")
        for split in SPLITS:
            total = index["sequences"][split]
            for shard in range(shard_count(total, per_shard)):
                first = shard * per_shard
                check_shard(shard_path(directory, split, shard), first, min(per_shard, total - first), index)
        return cls(directory, index)

    def _read(self, split: str, index: int, name: str):
        shard, local = divmod(index, self.per_shard)
        handle, aux_offsets, final_offsets = _open_shard(shard_path(self.directory, split, shard))
        offsets = aux_offsets if name == "aux" else final_offsets  # greedy: one per final row
        start, end = offsets[local], offsets[local + 1]
        scale = handle.get_slice(f"{name}_scale")[start:end] if self.scaled and name != "greedy" else None
        return handle.get_slice(name)[start:end], scale

    def hidden(self, split: str, indices: list[int], loss_mask: torch.Tensor, dtype: torch.dtype, device):
        """(aux as a list of [B, T, H], final [B, T, H]) for a right-padded batch, as `Target.capture`
        returns them, and the greedy tokens [B, T]; zero at padding, `final` and `greedy` zero away
        from teacher positions."""
        batch, width = loss_mask.shape
        hidden_size, layers = self.index["hidden_size"], len(self.index["layers"])
        aux = torch.zeros(batch, width, layers, hidden_size, dtype=dtype)
        final = torch.zeros(batch, width, hidden_size, dtype=dtype)
        greedy = torch.zeros(batch, width, dtype=torch.long)
        for row, index in enumerate(indices):
            values, scale = self._read(split, index, "aux")
            aux[row, : len(values)] = decode(values, scale, dtype)
            positions = teacher_positions(loss_mask[row].cpu())
            values, scale = self._read(split, index, "final")
            final[row, positions] = decode(values, scale, dtype)
            greedy[row, positions] = self._read(split, index, "greedy")[0].long()
        aux, final = aux.to(device), final.to(device)
        return [aux[:, :, k] for k in range(layers)], final, greedy.to(device)


class RegenCapture:
    """The hidden states regeneration computes anyway, kept for this cache: while the target answers
    a batch (`data.regenerate` with a cached run), the states the dump would compute over each
    training sequence are saved beside the answers, one file per batch, and the dump reads them
    instead of running the target over the data again (a second pass of the target over the whole
    data otherwise: docs/results.md). A sequence is found by its token ids; one whose teacher positions
    are not all stored (e.g. `data.loss_on=all`), or whose batch was answered without a capture,
    is computed by the target as before."""

    def __init__(self, target, layers: list[int], max_length: int):
        self.target, self.layers, self.max_length = target, [int(k) for k in layers], max_length
        what = [self.layers, str(target.lm_head_weight.dtype), max_length]  # the answers' key names the target
        self.key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]
        self.directory: Path | None = None  # set by data.regenerate: beside the answers it caches
        self._where: dict[str, tuple[str, int]] | None = None

    @staticmethod
    def _name(input_ids) -> str:
        return hashlib.sha256(torch.as_tensor(input_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()

    def save(self, sequences: list[list[int]], first_teachers: list[int], states: list[dict]) -> None:
        """One regeneration batch: `states` as data._decode returns them for these training sequences,
        whose first teacher position (their prompt's last token) is `first_teachers`."""
        kept = [{**s, "aux": s["aux"][: self.max_length]} for s in states]
        names = [self._name(ids[: self.max_length]) for ids in sequences]
        tensors = {name: torch.cat([s[name] for s in kept]).cpu().contiguous() for name in ("aux", "final", "greedy")}
        for name in ("aux", "final"):
            tensors[f"{name}_offsets"] = torch.tensor([0, *[len(s[name]) for s in kept]]).cumsum(0)
        tensors["first_teacher"] = torch.tensor(first_teachers)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"batch-{hashlib.sha256(''.join(names).encode()).hexdigest()[:16]}.safetensors")
        with atomic_file(path, key="regenerated data") as partial:
            save_file(tensors, partial, metadata={"sequences": json.dumps(names)})

    def states(self, input_ids, loss_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(aux [tokens, layers, H], final and greedy at the teacher positions) of one sequence, or None."""
        if self._where is None:
            self._where = {}
            for path in sorted(Path(self.directory).glob("batch-*.safetensors")) if self.directory else []:
                try:
                    with safe_open(str(path), framework="pt") as handle:
                        for row, name in enumerate(json.loads(handle.metadata()["sequences"])):
                            self._where[name] = (str(path), row)
                except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError) as error:
                    raise UserError(f"regenerated hidden states {path} are unreadable ({error}): delete the file, "
                                    "and the dump runs the target over its sequences") from None
        found = self._where.get(self._name(input_ids))
        if found is None:
            return None
        (path, row), positions = found, teacher_positions(loss_mask)
        handle, aux_offsets, final_offsets = _open_shard(path)
        final_start, final_end = final_offsets[row], final_offsets[row + 1]
        rows = positions - int(handle.get_slice("first_teacher")[row : row + 1][0])
        if len(rows) and (rows.min() < 0 or rows.max() >= final_end - final_start):
            return None
        return (handle.get_slice("aux")[aux_offsets[row] : aux_offsets[row + 1]],
                handle.get_slice("final")[final_start:final_end][rows], handle.get_slice("greedy")[final_start:final_end][rows])


def check_destination(directory: str) -> None:
    """Refuse, before any work, a cache directory that is not safe to write or already holds other files."""
    writes.check_destination(directory, key="data.cache.dir")
    check_cache_dir(directory)


def write(cfg: DictConfig, target, layers: list[int], train_set, eval_set, state, regenerated: RegenCapture | None = None) -> dict:
    """Run the target over the data (but over no sequence whose states `regenerated` kept) and
    write this process's missing shards of `data.cache.dir` (`state`: Accelerate's process state;
    process r writes shards r, r + N, ...); returns how many it wrote and skipped, and on the main
    process the finished cache's stats."""
    # the shard size is part of what a resumed dump must agree on, not of what training checks
    expected = {**identity(cfg, target, layers, train_set, eval_set),
                "shard_sequences": int(cfg.data.cache.shard_sequences)}
    directory = str(cfg.data.cache.dir)
    if state.is_main_process:
        begin(directory, expected)
    state.wait_for_everyone()

    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    datasets = {"train": train_set, "eval": eval_set}
    mine = [(split, shard) for split, dataset in datasets.items()
            for shard in range(state.process_index, shard_count(len(dataset), expected["shard_sequences"]), state.num_processes)]
    written = skipped = reused = computed = 0
    for split, shard in tqdm(mine, desc="dump", unit="shard", disable=not state.is_main_process, dynamic_ncols=True):
        path = shard_path(directory, split, shard)
        if os.path.exists(path):  # an earlier dump's, if it is whole and this cache's
            first = shard * expected["shard_sequences"]
            check_shard(path, first, min(expected["shard_sequences"], len(datasets[split]) - first), expected)
            skipped += 1
            continue
        copied, ran = write_shard(target, layers, datasets[split], shard, cfg.data.cache, pad_id, path, digest(expected),
                                  regenerated)
        reused, computed, written = reused + copied, computed + ran, written + 1
        log.info("dump: wrote %s", os.path.basename(path))
    log.info("dump process %d: wrote %d shards (%d sequences run through the target, %d copied from the states "
             "regeneration kept), skipped %d complete ones", state.process_index, written, computed, reused, skipped)
    state.wait_for_everyone()
    stats = finish(directory, expected) if state.is_main_process else None
    if stats:
        log.info("dump complete in %s: %s", directory, stats)
    return {"written": written, "skipped": skipped, "reused": reused, "cache": stats}


def check_cache_dir(directory: str) -> None:
    """A cache goes into a directory of its own: one that holds no cache yet must be new or empty."""
    check_creatable(directory, "data.cache.dir")
    if not os.path.isdir(directory) or read_index(directory) is not None:
        return
    others = sorted(name for name in os.listdir(directory) if not name.startswith("."))
    if others:
        raise UserError(f"data.cache.dir {directory} holds other files ({', '.join(others[:3])}"
                        f"{', ...' if len(others) > 3 else ''}): give a new or empty directory")


def begin(directory: str, expected: dict) -> None:
    """Start or continue a dump: a cache made for anything else is refused, never mixed in."""
    os.makedirs(directory, exist_ok=True)
    stored = read_index(directory)
    if stored is None:
        write_index(directory, {**expected, "complete": False})
    else:
        check_identity(directory, stored, expected)
    remove_stale_partials(directory, every_name=True)  # shards a killed writer left half-written


def _encoded(aux: torch.Tensor, final: torch.Tensor, greedy: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """One sequence as a shard stores it: aux [tokens, layers, H]; final and greedy at its teacher positions."""
    stored = {"greedy": greedy.to(torch.int32).cpu()}
    for name, vectors in (("aux", aux), ("final", final)):
        values, scale = encode(vectors, dtype)  # on the target's device
        stored[name] = values.cpu()
        if scale is not None:
            stored[f"{name}_scale"] = scale.cpu()
    return stored


def write_shard(target, layers, dataset, shard: int, cache_cfg: DictConfig, pad_id: int, path: str, cache: str,
                regenerated: RegenCapture | None = None) -> tuple[int, int]:
    """Write one shard, recording the `cache` digest it belongs to; returns how many of its sequences were copied from the states `regenerated`
    kept and how many the target ran over."""
    per_shard, dtype = int(cache_cfg.shard_sequences), str(cache_cfg.dtype)
    first = shard * per_shard
    indices = list(range(first, min(first + per_shard, len(dataset))))
    encoded: dict[int, dict[str, torch.Tensor]] = {}
    for index in indices if regenerated is not None else []:
        kept = regenerated.states(dataset[index]["input_ids"], dataset[index]["loss_mask"])
        if kept is not None:
            encoded[index] = _encoded(*kept, dtype)
    # the target runs over batches of similar lengths (the full preset's data: 1.11x the real tokens
    # computed instead of 1.49x in dataset order); the shard stores its sequences in dataset order
    by_length = sorted((i for i in indices if i not in encoded), key=lambda i: len(dataset[i]["input_ids"]))
    for start in range(0, len(by_length), int(cache_cfg.batch_size)):
        chunk = by_length[start : start + int(cache_cfg.batch_size)]
        batch = {name: tensor.to(target.device) for name, tensor in data.collate([dataset[i] for i in chunk], pad_id).items()}
        aux, final = target.capture(batch["input_ids"], batch["attention_mask"], layers)
        aux = torch.stack(aux, 2)  # [B, T, layers, H]
        for row, index in enumerate(chunk):
            tokens = int(batch["attention_mask"][row].sum())
            positions = teacher_positions(batch["loss_mask"][row, :tokens])
            encoded[index] = _encoded(aux[row, :tokens], final[row, positions], target.argmax(final[row, positions]), dtype)
    parts = {name: [encoded[i][name] for i in indices] for name in encoded[indices[0]]}
    lengths = {name: [len(encoded[i][name]) for i in indices] for name in ("aux", "final")}
    tensors = {name: torch.cat(chunks) for name, chunks in parts.items()}
    for name, counts in lengths.items():
        tensors[f"{name}_offsets"] = torch.tensor([0, *counts]).cumsum(0)
    with atomic_file(path, key="data.cache.dir") as partial:  # complete or absent: what a restart relies on
        save_file(tensors, partial, metadata={"first_sequence": str(first), "sequences": str(len(indices)), "cache": cache})
    return len(indices) - len(by_length), len(by_length)


def finish(directory: str, expected: dict) -> dict:
    """Check every shard is there, then mark the index complete with the cache's size."""
    shards = all_shards(directory, expected)
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
    write_index(directory, {**expected, "complete": True, "stats": stats})
    return stats
