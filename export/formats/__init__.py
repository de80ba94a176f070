"""Artifact formats: one small writer per format and drafter, plus a reader where the format is
another engine's (to import its heads), found through a registry.

A format module calls `register(Format(...))` when imported, and every module of this package is
imported on first lookup: a new drafter adds its formats as modules here, with no per-format
branching in drafters/ or export/run.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from drafters.base import Registry, build_drafter
from drafters.config.errors import UserError
from drafters.storage.artifact import SavedDrafter, default_proposal, verifier_of
from drafters.target.model import Target, TargetSpec
from drafters.target.vocab import DraftVocab

ANY_DRAFTER = "*"


@dataclass(frozen=True)
class ImportFor:
    """What importing another engine's head takes from our side."""

    target: Target  # the target it will run on (its spec; its embedding where the head ships none)
    target_cfg: dict  # the conf/target node that loads it, recorded in the artifact
    drafter_cfg: dict  # our config of the drafter it becomes (defaults for what their files lack)


def check_sizes(config: dict, spec: TargetSpec, where: str) -> None:
    """The hidden and vocabulary sizes a head's config.json names, where it names them, are the target's."""
    for field in ("hidden_size", "vocab_size"):
        if field in config and config[field] != getattr(spec, field):
            raise UserError(f"{where}: a head for {field}={config[field]}, the target {spec.name} "
                            f"has {field}={getattr(spec, field)}")


def draft_vocabulary(token_map: torch.Tensor | None, vocab_size: int, where: str) -> tuple[DraftVocab, torch.Tensor]:
    """Our draft vocabulary from another engine's token map (the target id of each of its draft
    tokens, in its order; None: the whole vocabulary), and the order that sorts its draft tokens
    into ours (ascending target ids)."""
    if token_map is None:
        token_map = torch.arange(vocab_size)
    ids, order = token_map.long().flatten().sort()
    if not len(ids) or ids[0] < 0 or ids[-1] >= vocab_size or bool((ids[1:] == ids[:-1]).any()):
        raise UserError(f"{where}: the token map ({len(ids)} ids) is no draft vocabulary of the target's "
                        f"{vocab_size} tokens (ids outside it, or repeated)")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return DraftVocab(ids - torch.arange(len(ids)), t2d, key={"imported": where}), order


def built_on_target(where: str, drafter: str, settings: dict, vocab: DraftVocab, theirs: dict[str, torch.Tensor],
                    context: ImportFor) -> SavedDrafter:
    """Another engine's head (`theirs`: its tensors under our names) as our `drafter`, `settings`
    over our config of it. Built on the target, the drafter gives what it takes from the target
    (its frozen parts: embedding, lm_head rows, final norm; the vocabulary maps) where their files
    have none. Strict: any other missing tensor, an unknown one or a wrong shape is one UserError line."""
    cfg = {**context.drafter_cfg, **settings, "name": drafter, "draft_vocab_size": vocab.draft_size}
    built = build_drafter(OmegaConf.create(cfg), context.target, vocab)
    trained = {name for name, parameter in built.named_parameters() if parameter.requires_grad}
    dtype = next((tensor.dtype for tensor in theirs.values() if tensor.is_floating_point()), torch.float32)
    weights = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
               for name, tensor in built.state_dict().items() if name not in trained}
    weights.update({name: tensor.clone() for name, tensor in theirs.items()})  # their files may share a tensor
    hparams = built.hparams()
    saved = SavedDrafter(drafter, hparams, verifier_of(context.target.spec.to_dict(), context.target_cfg),
                         context.target_cfg, weights, default_proposal(drafter, hparams))
    saved.check_weights(where)
    return saved


@dataclass(frozen=True)
class Format:
    name: str  # format=<name>
    drafter: str  # the drafter it writes and reads (ANY_DRAFTER: all)
    write: Callable[[SavedDrafter, str], None]  # the artifact's files into an empty directory
    recognizes: Callable[[dict], bool] | None = None  # another engine's format: is a config.json ours to read
    read: Callable[[str, dict, ImportFor], SavedDrafter] | None = None  # (dir, its config.json, ...) -> ours
    options: tuple[str, ...] = ()  # export settings `write` takes as keyword arguments (conf/export.yaml)

    def write_checked(self, saved: SavedDrafter, directory: str, where: str, **options) -> None:
        """Keys and shapes are checked before anything is written: a bad checkpoint never becomes an artifact."""
        saved.check_weights(where)
        self.write(saved, directory, **{name: options[name] for name in self.options})


FORMATS = Registry(__name__)


def register(fmt: Format) -> None:
    FORMATS[fmt.name, fmt.drafter] = fmt


def named(name: str) -> list[Format]:
    """The formats called `name` (one per drafter), or the one-line error listing the known names."""
    found = [fmt for fmt in FORMATS.everything().values() if fmt.name == name]
    if not found:
        raise UserError(f"unknown format '{name}' (available: {', '.join(sorted({fmt.name for fmt in FORMATS.values()}))})")
    return found


def writer(name: str, drafter: str) -> Format:
    candidates = named(name)
    for fmt in candidates:
        if fmt.drafter in (drafter, ANY_DRAFTER):
            return fmt
    raise UserError(f"format '{name}' has no writer for drafter '{drafter}' "
                    f"(it has: {', '.join(fmt.drafter for fmt in candidates)})")


def reader(config: dict, where: str) -> Format:
    """The format whose reader takes a dir with this config.json."""
    for fmt in FORMATS.everything().values():
        if fmt.recognizes and fmt.recognizes(config):
            return fmt
    readable = ", ".join(f"{fmt.name} ({fmt.drafter})" for fmt in FORMATS.values() if fmt.read)
    raise UserError(f"{where}: config.json is no layout this version reads "
                    f"(a specdraft checkpoint or native artifact, or {readable})")
