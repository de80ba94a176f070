"""Draft vocabulary: the N target tokens the drafter predicts, as a saved, versioned artifact.

Draft ids are sorted ascending by target id. ``d2t[draft_id]`` is the offset to add to get the
target id (the EAGLE-3 / SpecForge / vLLM convention); ``t2d[target_id]`` is True iff the target
token is in the draft vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from drafters.config.errors import UserError
from drafters.storage.writes import atomic_file

FORMAT = "specdraft.draft_vocab"
VERSION = 1

# Masked tokens are counted in chunks of this many, so the bincount over the whole target
# vocabulary (262k for Gemma) runs once per chunk rather than once per example.
_COUNT_CHUNK = 1 << 20


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [draft_size]: target_id - draft_id
    t2d: torch.Tensor  # bool [target_size]
    key: dict  # what it was built from (tokenizer, data, size, ...); decides reuse

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id (ascending)."""
        return torch.arange(len(self.d2t)) + self.d2t

    @property
    def draft_size(self) -> int:
        return len(self.d2t)

    @property
    def target_size(self) -> int:
        return len(self.t2d)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically, so an interrupted save never leaves a half-written vocab behind."""
        metadata = {"format": FORMAT, "version": str(VERSION), "key": json.dumps(self.key, sort_keys=True)}
        with atomic_file(str(path), key="draft vocabulary") as partial:
            save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, partial, metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> DraftVocab:
        """Read and validate a saved vocab; a wrong format, version or content is a UserError."""
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                if metadata.get("format") != FORMAT:
                    raise UserError(f"{path}: not a draft vocabulary file")
                if metadata.get("version") != str(VERSION):
                    found = metadata.get("version")
                    raise UserError(f"{path}: draft vocabulary format version {found}, expected {VERSION}")
                vocab = cls(f.get_tensor("d2t"), f.get_tensor("t2d"), json.loads(metadata["key"]))
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: unreadable draft vocabulary ({e})") from None
        ids = vocab.draft_ids
        if (
            vocab.d2t.dtype != torch.int64
            or vocab.t2d.dtype != torch.bool
            or int(vocab.t2d.sum()) != vocab.draft_size
            or (vocab.draft_size and (ids.min() < 0 or ids.max() >= vocab.target_size or not vocab.t2d[ids].all()))
        ):
            raise UserError(f"{path}: inconsistent draft vocabulary (d2t and t2d disagree)")
        return vocab


def build_draft_vocab(
    token_streams: Iterable[tuple[list[int], list[int]]],
    target_vocab_size: int,
    draft_vocab_size: int,
    key: dict,
) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent loss-masked target tokens of ``token_streams``
    (pairs of input_ids, loss_mask). Ties go to the lower id; if fewer distinct tokens were seen,
    the lowest-id unseen tokens fill the rest so the size is exact. N >= V gives the identity.
    """
    if draft_vocab_size <= 0:
        raise UserError(f"draft vocabulary size must be positive, got {draft_vocab_size}")
    if draft_vocab_size >= target_vocab_size:
        return DraftVocab(
            torch.zeros(target_vocab_size, dtype=torch.long), torch.ones(target_vocab_size, dtype=torch.bool), key
        )

    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    pending: list[torch.Tensor] = []
    pending_len = 0

    def flush() -> None:
        nonlocal pending_len
        tokens = torch.cat(pending)
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= target_vocab_size):
            bad = int(tokens.max()) if tokens.max() >= target_vocab_size else int(tokens.min())
            raise UserError(
                f"token id {bad} outside the target vocabulary of {target_vocab_size}: "
                "tokenizer and target do not match"
            )
        counts.add_(torch.bincount(tokens, minlength=target_vocab_size))
        pending.clear()
        pending_len = 0

    for input_ids, loss_mask in token_streams:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        pending.append(ids[torch.as_tensor(loss_mask, dtype=torch.bool)])
        pending_len += len(pending[-1])
        if pending_len >= _COUNT_CHUNK:
            flush()
    if pending:
        flush()

    # A stable descending sort keeps equal counts in ascending id order, which both breaks ties
    # by the lower id and pads with the lowest-id unseen (count 0) tokens.
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = order[:draft_vocab_size].sort().values
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return DraftVocab(chosen - torch.arange(draft_vocab_size), t2d, key)


def _normalized(key: dict) -> dict:
    """The key as it reads back from JSON (tuples become lists), so comparisons are fair."""
    return json.loads(json.dumps(key, sort_keys=True))


def load_or_build(path: str | os.PathLike, key: dict, build: Callable[[], DraftVocab]) -> tuple[DraftVocab, str]:
    """Reuse the vocab saved at ``path`` if it was built from ``key``, else build and save it.

    Returns the vocab and what happened: ``"reused"``, ``"built"``, or ``"rebuilt: <why>"``
    naming the key fields that changed, so a stale vocab is never used silently.
    """
    key = _normalized(key)
    reason = "built"
    if os.path.exists(path):
        try:
            stored = DraftVocab.load(path)
        except UserError as e:
            reason = f"rebuilt: {e}"
        else:
            if stored.key == key:
                return stored, "reused"
            changed = sorted(k for k in stored.key.keys() | key.keys() if stored.key.get(k) != key.get(k))
            reason = f"rebuilt: {', '.join(changed)} changed"
    vocab = build()
    if _normalized(vocab.key) != key:
        raise ValueError(f"build() returned a vocab keyed {vocab.key}, expected {key}")
    vocab.save(path)
    return vocab, reason


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what makes token ids mean something: vocabulary, special tokens, chat template."""
    state = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": tokenizer.all_special_tokens,
        "special_map": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]
