"""The drafter interface, its registry, and the teacher signal every drafter trains on."""

from __future__ import annotations

import importlib
import pkgutil
import typing
from dataclasses import dataclass
from typing import Protocol

import torch
from omegaconf import DictConfig
from torch import nn

from drafters.config import settings
from drafters.config.errors import UserError
from drafters.target.model import Target, TargetSpec
from drafters.target.vocab import DraftVocab


class Registry(dict):
    """What the modules of one package register as they are imported (drafters here, artifact formats
    in export/formats/). Every module of the package is imported at the first lookup, so a new module
    is all it takes to add an entry."""

    def __init__(self, package: str):
        super().__init__()
        self.package, self.complete = package, False

    def __setitem__(self, key, value):
        if key in self and self[key] is not value:  # two modules claiming one name: the later would win silently
            raise ValueError(f"{self.package}: {key!r} is registered twice ({self[key]!r} and {value!r})")
        super().__setitem__(key, value)

    def everything(self) -> "Registry":
        if not self.complete:
            for module in pkgutil.iter_modules(importlib.import_module(self.package).__path__):
                importlib.import_module(f"{self.package}.{module.name}")
            self.complete = True
        return self


DRAFTERS = Registry("drafters")


def register(name: str):
    """Class decorator: `@register("eagle3")` makes the drafter reachable as `drafter=eagle3`."""

    def add(cls):
        cls.name = name
        DRAFTERS[name] = cls
        return cls

    return add


def drafter_class(name: str) -> type["Drafter"]:
    if name not in DRAFTERS.everything():
        raise UserError(f"unknown drafter '{name}' (available: {', '.join(sorted(DRAFTERS))})")
    return DRAFTERS[name]


@dataclass
class Captured:
    """What the frozen target says about a batch, restricted to what drafters learn from. The teacher
    fields are computed only at teacher positions (the next token is trained on: the only places any
    loss or metric reads them) and are zero elsewhere."""

    aux: list[torch.Tensor]  # hidden states entering the drafter's capture layers, each [B, T, H]
    final: torch.Tensor  # final normed hidden state [B, T, H]
    teacher_logits: torch.Tensor  # target logits over the draft vocabulary [B, T, V_draft]
    in_vocab: torch.Tensor  # [B, T] bool: the target's greedy token at t is in the draft vocabulary
    teacher_token: torch.Tensor  # [B, T] the target's greedy token at t, as a draft id (0 where not in vocab)


@torch.no_grad()
def capture(target: Target, vocab: DraftVocab, batch: dict, layers: list[int]) -> Captured:
    aux, final = target.capture(batch["input_ids"], batch["attention_mask"], layers)
    return teacher_signal(target, vocab, aux, final, batch["loss_mask"])


@torch.no_grad()
def teacher_signal(target: Target, vocab: DraftVocab, aux: list[torch.Tensor], final: torch.Tensor,
                   loss_mask: torch.Tensor, greedy: torch.Tensor | None = None) -> Captured:
    """The teacher from hidden states just captured, or read back from the offline cache
    (training/hidden_cache.py), which keeps `final` only where a next token is trained on and the
    target's greedy tokens there (`greedy` [B, T]: the full-vocabulary argmax, most of this
    function's cost otherwise). Computed on those rows alone: about half of a padded batch's."""
    rows = torch.nn.functional.pad(loss_mask[:, 1:], (0, 1)).bool()
    hidden = final[rows]
    greedy = target.argmax(hidden) if greedy is None else greedy[rows]
    t2d = vocab.t2d.to(final.device)
    # target id -> draft id: the count of draft tokens below it (draft ids are sorted by target id)
    to_draft = torch.cumsum(t2d.long(), 0) - 1
    logits = target.logits(hidden, vocab.draft_ids.to(final.device))
    teacher_logits = logits.new_zeros(*rows.shape, logits.shape[-1])
    teacher_logits[rows] = logits
    in_vocab = torch.zeros_like(rows)
    in_vocab[rows] = t2d[greedy]
    teacher_token = torch.zeros(rows.shape, dtype=torch.long, device=final.device)
    teacher_token[rows] = torch.where(t2d[greedy], to_draft[greedy], 0)
    return Captured(aux=aux, final=final, teacher_logits=teacher_logits, in_vocab=in_vocab, teacher_token=teacher_token)


class DraftState(Protocol):
    """A drafter's serving state (a DraftCache, DFlash's ContextCache, gemma_mtp's TargetContext):
    `length` context entries, cropped back to the committed tokens after each verification."""

    length: int

    def crop(self, length: int) -> None: ...


class Drafter(nn.Module):
    """A draft head: training (`loss` on what the target says) and serving (what serving/engine.py
    calls; drafters/proposal.py implements it for the two shapes of drafter). Subclasses live in one
    file each and register themselves."""

    name: str = ""
    Settings: type = settings.Drafter  # the keys of its conf/drafter/*.yaml, their types and ranges
    layer_config = None  # the LlamaConfig of its draft decoder layers, if Llama-shaped: saved for engines
    progress = 1.0  # the share of the training run done (the trainer sets it each step): for curricula
    proposal_steps: int | None = None  # drafts per forward its artifact records (export steps=), if loaded from one

    def __init__(self, cfg: DictConfig, spec: TargetSpec, vocab: DraftVocab):
        super().__init__()
        self.cfg, self.spec, self.vocab = cfg, spec, vocab
        # draft id -> target id offset, and which target ids are drafted: saved with the weights
        self.register_buffer("d2t", vocab.d2t.clone(), persistent=True)
        self.register_buffer("t2d", vocab.t2d.clone(), persistent=True)

    def capture_layers(self) -> list[int]:
        """Target layers (docs/design.md convention: input of layer k) this drafter conditions on."""
        raise NotImplementedError

    def init_from_target(self, target: Target) -> None:
        """Copy (frozen) weights the drafter shares with its target, e.g. the token embedding."""

    def loss(self, batch: dict, captured: Captured) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training loss and metrics (`acc/k` for k = 1..K, top-1 agreement with the target), each
        metric a detached 0-dim tensor: the trainer reads them only when it logs."""
        raise NotImplementedError

    def forward(self, batch: dict, captured: Captured):
        # DDP/DeepSpeed wrap `forward`, so training calls the module, not `.loss` directly
        return self.loss(batch, captured)

    def hparams(self) -> dict:
        """What rebuilds this drafter, stored in checkpoints and artifacts: its saved settings as it
        resolved them (an attribute of the same name where it fills in a default, else the config's
        value), then its `layer_config`, if any."""
        hints = typing.get_type_hints(self.Settings)
        chosen = {spec.name: self.__dict__.get(spec.name, self.cfg.get(spec.name))
                  for spec in settings.saved_fields(self.Settings)}
        chosen["draft_vocab_size"] = self.vocab.draft_size  # the vocabulary it was built over, which decides its shapes
        hparams = {name: settings.plain(value, hints[name]) for name, value in chosen.items()}
        return hparams | ({"layer_config": self.layer_config.to_dict()} if self.layer_config is not None else {})

    @classmethod
    def default_steps(cls, hparams: dict) -> int:
        """Drafts per target forward when serving is not told (`steps=`): what a drafter with these
        hyper-parameters was trained to draft; here the unroll it was trained for (`ttt_steps`)."""
        return int(hparams["ttt_steps"])

    def new_cache(self, target_cache=None) -> DraftState:
        """A fresh serving state; `target_cache` (the target's KV cache, kept in step with the committed
        tokens) is there for drafters that read it (Gemma-style MTP assistants)."""
        raise NotImplementedError

    def extend(self, cache: DraftState, aux: list[torch.Tensor], next_tokens: torch.Tensor):
        """Add context entries for the target's features `aux` [B, n, H] each, with the tokens committed
        after them [B, n]; returns (feature, draft logits) to propose from."""
        raise NotImplementedError

    def propose_chain(self, cache: DraftState, feature, logits, steps: int, draw=None, stop=None):
        """Up to `steps` drafts: (target ids [B, k], distributions [B, k, V_draft], confidences [B, k],
        the drafter's estimate that each is accepted). `draw(logits) -> (draft ids, distribution)`
        picks (default greedy); `stop(confidences so far)` may end the chain early."""
        raise NotImplementedError

    def propose_tree(self, cache: DraftState, feature, logits, depth: int, topk: int, total: int, draw=None):
        """A tree of at most `total` drafts: (target ids [n], parents [n] with 0 = the last committed
        token, distributions [1 + n, V_draft] each node's children were drawn from, or None greedy)."""
        raise NotImplementedError


def check_settings(cfg: DictConfig) -> type[Drafter]:
    """The drafter class `drafter.name` names, once `cfg` (the `drafter` node) fits its Settings."""
    cls = drafter_class(cfg.name)
    settings.check(cfg, cls.Settings, "drafter.")
    return cls


def build_drafter(cfg: DictConfig, target: Target, vocab: DraftVocab) -> Drafter:
    drafter = check_settings(cfg)(cfg, target.spec, vocab)
    target.check_layers(drafter.capture_layers())
    drafter.init_from_target(target)
    return drafter


def greedy_draw(logits: torch.Tensor):
    """The most likely draft token and the draft distribution (its max is the drafter's confidence)."""
    dist = torch.softmax(logits.float(), -1)
    return dist.argmax(-1), dist


def sim_accept_len(acc: list[float]) -> float:
    """Expected accepted tokens per target forward for a chain: 1 (bonus) + sum_k prod_{i<=k} acc_i."""
    total, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        total += prod
    return total
