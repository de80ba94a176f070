"""Medusa (Cai et al., 2024): K heads on the target's last hidden state, each guessing one token
further ahead.

Head k (1..K) is a stack of residual blocks `x + SiLU(W x + b)` and its own lm_head (started as
the target's, draft-vocabulary rows). It reads h_t, the target's final normed hidden state at t,
and predicts token t+1+k: the target's own lm_head on h_t already gives token t+1. Training
distills the target: cross-entropy against its distribution of token t+1+k (the teacher at t+k),
head k weighted decay^(k-1); on data the target regenerated (`data.regenerate=true`) that is
distillation on the target's own answers.

Serving keeps no drafter context. After each verification the engine hands over the hidden
states of the accepted positions; the last is h_t at the last accepted token, whose lm_head gave
the bonus token (t+1), so the heads' guesses are the tokens after the bonus, t+2 .. t+1+K. A
chain takes each head's top token; a tree is Medusa's Cartesian tree of the heads' top-k tokens,
its best nodes picked best-first (`best_nodes`). Verification stays the engine's: lossless greedy
or exact rejection sampling (no "typical acceptance").

Weight names are those of vLLM's `MedusaModel` (`blocks.{k}.layers.{j}`, `lm_heads.{k}`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import Captured, register
from drafters.config import settings
from drafters.config.settings import above, at_least
from drafters.layers import DraftCache, TargetNorm
from drafters.losses import distill, shifted_teacher, trained_positions
from drafters.proposal import ParallelDrafter


class ResidualBlocks(nn.Module):
    """`x + SiLU(linear(x))`, `depth` times. Zero-initialized, so a new head starts out as the
    target's own next-token head and training moves it further ahead."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


@register("medusa")
class Medusa(ParallelDrafter):
    @dataclass
    class Settings(settings.Drafter):
        num_heads: int = at_least(1)
        num_layers: int = at_least(0)  # residual blocks per head
        loss_decay: float = above(0)

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        width = spec.hidden_size
        self.target_norm = TargetNorm(spec)
        self.blocks = nn.ModuleList(ResidualBlocks(width, int(cfg.num_layers)) for _ in range(int(cfg.num_heads)))
        self.lm_heads = nn.ModuleList(nn.Linear(width, vocab.draft_size, bias=False) for _ in self.blocks)

    @classmethod
    def default_steps(cls, hparams):
        return int(hparams["num_heads"])

    @torch.no_grad()
    def init_from_target(self, target):
        self.target_norm.copy_from(target)
        for lm_head in self.lm_heads:
            lm_head.weight.copy_(target.lm_head_weight[self.vocab.draft_ids].float())

    def capture_layers(self):
        return [self.spec.num_layers]  # the last layer's output, which `hidden` norms

    def hidden(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """h_t: the target's final normed hidden state, what its lm_head (and so each head) reads."""
        return self.target_norm(aux[0].to(self.target_norm.weight.dtype))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K, V_draft]: every head's guess from the same hidden states."""
        return torch.stack([lm_head(block(hidden)) for block, lm_head in zip(self.blocks, self.lm_heads)], -2)

    def loss(self, batch: dict, captured: Captured):
        length = batch["input_ids"].shape[1]
        hidden = self.hidden(captured.aux)
        predicts = trained_positions(batch, captured)
        teacher = shifted_teacher(captured, predicts)
        total, metrics = 0.0, {}
        for k, (block, lm_head) in enumerate(zip(self.blocks, self.lm_heads), 1):
            # head k at t predicts token t+1+k: the teacher at t+k
            rows = predicts[:, k:]
            logits = lm_head(block(hidden[:, : length - k][rows]))
            head_loss, metrics[f"acc/{k}"] = distill(logits, teacher(k), captured.teacher_token[:, k:][rows],
                                                     self.cfg.get("loss", "soft_ce"))
            total = total + float(self.cfg.loss_decay) ** (k - 1) * head_loss
            metrics[f"loss/{k}"] = head_loss.detach()
        return total, metrics

    # ---- serving: chains and trees of the heads' guesses (ParallelDrafter)

    def new_cache(self, target_cache=None) -> DraftCache:
        return DraftCache()  # stays empty: the heads read nothing but the newest hidden state

    @torch.no_grad()
    def extend(self, cache: DraftCache, aux: list[torch.Tensor], next_tokens: torch.Tensor):
        """`aux` rows: the positions just committed, each followed by its token in `next_tokens`. The
        last row is h_t, followed by the bonus token: returns (h_t [B, 1, H], the heads' logits
        [B, K, V_draft] for the tokens after the bonus)."""
        hidden = self.hidden([states[:, -1:] for states in aux])
        return hidden, self.head_logits(hidden[:, 0])
