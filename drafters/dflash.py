"""DFlash (Chen et al., 2026): a block drafter that proposes a whole block of tokens in ONE forward.

A small decoder stack with no embedding or lm_head of its own in spirit (both start as the
target's; the embedding stays frozen). Hidden states entering several target layers, spread from
layer 1 to N-3, are concatenated, projected (`fc: L*H -> H`) and normed (`hidden_norm`): that is
the context. Every draft layer's keys/values are concat(K/V of the context, K/V of the block),
its queries come from the block alone. The block is [last committed token, mask, ..., mask]
(`block_size` slots, a fixed mask token id whose embedding is the target's), attended
non-causally within the block, at positions p..p+block_size-1 after a context of p positions:
slot j >= 1 drafts token p+j, so one forward gives block_size-1 drafts.

Training picks random anchor positions per sequence (`blocks_per_sequence` blocks, each anchored
where the next token is an assistant token); block j sees the context strictly before its anchor
and itself. Loss: cross-entropy against the target's distribution of each drafted token, slot j
weighted exp(-(j-1)/gamma) (DFlash's position decay).

Weight names and the layer (Qwen3-style: per-head q/k RMSNorm) follow the DFlash heads speculators
trains and vLLM serves (`layers.{i}.*`, `fc`, `hidden_norm`, `norm`, `lm_head`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from drafters.base import Captured, register
from drafters.config import settings
from drafters.config.errors import UserError
from drafters.config.settings import above, anything, at_least
from drafters.layers import ContextAttention, DraftLayer, KVBuffer, add_fused_head, copy_target_head, draft_layer_config
from drafters.losses import divergence, trained_positions
from drafters.proposal import ParallelDrafter


class DFlashLayer(DraftLayer):
    """A pre-norm decoder layer whose attention also sees the target context's keys/values."""

    def __init__(self, config):
        super().__init__(config, config.hidden_size, qk_norm=True)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, context_kv, cos, sin, mask=None):
        return super().forward(self.input_layernorm(h), h, cos, sin, ContextAttention(*context_kv, mask))


class ContextCache:
    """Serving state: every draft layer's keys/values of the target context (RoPE'd at their
    positions), cropped back to the committed tokens after each verification."""

    def __init__(self, num_layers: int):
        self.layers = [KVBuffer() for _ in range(num_layers)]
        self.last_token: torch.Tensor | None = None  # [B, 1] the block's anchor (DSpark's first Markov input)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)


@dataclass
class BlockRows:
    """The trained block slots of a batch, one row each."""

    hidden: torch.Tensor  # [R, H] the draft stack's normed output at the slot
    teacher: torch.Tensor  # [R, V_draft] the target's distribution of the token the slot drafts
    teacher_token: torch.Tensor  # [R] the target's greedy token there (draft id)
    slot: torch.Tensor  # [R] j in 1..block_size-1
    previous: torch.Tensor  # [R] the data token right before the drafted one (target id)


@register("dflash")
class DFlash(ParallelDrafter):
    @dataclass
    class Settings(settings.Drafter):
        block_size: int = at_least(2)
        num_layers: int = at_least(1)
        aux_layers: list[int] | None = at_least(0, distinct=True)
        num_aux: int = at_least(1, saved=False)  # aux_layers records the layers it chose
        mask_token_id: int | None = at_least(0)
        blocks_per_sequence: int = at_least(1)
        loss_gamma: float = above(0)
        init_head_from_target: bool = anything(saved=False)

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        self.block_size, num_layers = int(cfg.block_size), int(cfg.num_layers)
        self.mask_token_id = spec.vocab_size - 1 if cfg.get("mask_token_id") is None else int(cfg.mask_token_id)
        if not 0 <= self.mask_token_id < spec.vocab_size:
            raise UserError(f"drafter.mask_token_id={self.mask_token_id} is outside the target's vocabulary "
                            f"(0..{spec.vocab_size - 1})")
        if not cfg.get("aux_layers") and int(cfg.get("num_aux", 5)) > max(spec.num_layers - 3, 1):
            raise UserError(f"drafter.num_aux={cfg.num_aux}: more aux layers than the {max(spec.num_layers - 3, 1)} "
                            f"it spreads them over (target layers 1..N-3 of {spec.name}): lower it or pass drafter.aux_layers")
        self.aux_layers = (list(cfg.aux_layers) if cfg.get("aux_layers")
                           else spread_aux_layers(spec.num_layers, int(cfg.get("num_aux", 5))))
        self.layer_config = draft_layer_config(spec, num_layers)
        add_fused_head(self, spec, vocab, len(self.aux_layers), self.layer_config)
        self.hidden_norm = LlamaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(self.layer_config) for _ in range(num_layers))

    def capture_layers(self):
        return self.aux_layers

    @classmethod
    def default_steps(cls, hparams):
        return max(1, int(hparams["block_size"]) - 1)  # the block's first slot holds the bonus token

    def init_from_target(self, target):
        copy_target_head(self, target)

    def context(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """[B, T, H]: the normed projection of the target's hidden states, what the layers' K/V read."""
        return self.hidden_norm(self.fc(torch.cat(aux, -1).to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor):
        """Every layer's (keys, values) of the context at `positions` [1 or B, T]."""
        cos, sin = self.rotary(context, positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def run_block(self, tokens, positions, context_kv, mask=None) -> torch.Tensor:
        """The draft stack over block `tokens` [B, Q] at `positions` [B, Q]: normed hidden [B, Q, H].
        `mask` [B, 1, Q, context + Q] says what each slot sees (None: everything)."""
        h = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rotary(h, positions)
        for layer, kv in zip(self.layers, context_kv):
            h = layer(h, kv, cos, sin, mask)
        return self.norm(h)

    def block_tokens(self, anchors: torch.Tensor) -> torch.Tensor:
        """[..., block_size]: each anchor token followed by mask tokens."""
        tokens = anchors.new_full((*anchors.shape, self.block_size), self.mask_token_id)
        tokens[..., 0] = anchors
        return tokens

    # ---- training

    def sample_anchors(self, predicts: torch.Tensor):
        """Up to `blocks_per_sequence` distinct random anchors per row [B, N] and whether each is real
        [B, N]: positions a >= 1 whose next token is trained on and whose block fits the sequence."""
        length = predicts.shape[1]
        count = min(int(self.cfg.blocks_per_sequence), length)
        candidates = predicts.clone()
        candidates[:, 0] = False
        candidates[:, length - self.block_size + 2:] = False  # slot block_size-1's teacher sits at a+block_size-2
        scores = torch.rand(predicts.shape, device=predicts.device).masked_fill(~candidates, -1.0)
        best = scores.topk(count, -1)
        return best.indices, best.values >= 0

    def block_rows(self, batch: dict, captured: Captured) -> BlockRows:
        input_ids = batch["input_ids"]
        rows, length = input_ids.shape
        predicts = trained_positions(batch, captured)
        anchors, real = self.sample_anchors(predicts)
        blocks, size = anchors.shape[1], self.block_size
        slots = torch.arange(size, device=input_ids.device)
        positions = (anchors[..., None] + slots).view(rows, blocks * size)
        tokens = self.block_tokens(input_ids.gather(1, anchors)).view(rows, blocks * size)
        # a block's slots see the context strictly before its anchor, and their whole block
        block_anchor = anchors.repeat_interleave(size, 1)  # [B, Q]
        sees_context = torch.arange(length, device=input_ids.device) < block_anchor[..., None]
        block_of = torch.arange(blocks * size, device=input_ids.device) // size
        same_block = (block_of[:, None] == block_of[None, :]).expand(rows, -1, -1)
        mask = torch.cat([sees_context, same_block], -1)[:, None]
        context = self.context(captured.aux)
        full = torch.arange(length, device=input_ids.device)[None].expand(rows, -1)
        hidden = self.run_block(tokens, positions, self.context_kv(context, full), mask)
        # slot j >= 1 drafts token a+j, whose teacher is the target's distribution at a+j-1
        teacher_at = (anchors[..., None] + slots[1:] - 1).clamp(max=length - 1)  # [B, N, size-1]
        trained = real[..., None] & predicts.gather(1, teacher_at.view(rows, -1)).view_as(teacher_at)
        batch_index = torch.arange(rows, device=input_ids.device)[:, None, None].expand_as(teacher_at)
        b, t = batch_index[trained], teacher_at[trained]
        return BlockRows(
            hidden=hidden.view(rows, blocks, size, -1)[:, :, 1:][trained],
            teacher=torch.softmax(captured.teacher_logits[b, t].float(), -1),
            teacher_token=captured.teacher_token[b, t],
            slot=slots[1:].expand_as(teacher_at)[trained],
            previous=input_ids[b, t],
        )

    def slot_weights(self) -> torch.Tensor:
        """exp(-(j-1)/gamma) for slots j = 1..block_size-1."""
        return torch.exp(-torch.arange(self.block_size - 1) / float(self.cfg.loss_gamma))

    def per_slot(self, values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """[block_size-1]: the mean of per-row `values` [R] over each slot's rows (0 where none)."""
        sums = torch.zeros(self.block_size - 1, device=values.device).index_add(0, slot - 1, values.float())
        counts = torch.bincount(slot - 1, minlength=self.block_size - 1).clamp(min=1)
        return sums / counts

    def decayed(self, values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The slot-decayed mean of per-row `values`, normalized by the weights of the slots present."""
        weights = self.slot_weights().to(values.device)
        present = torch.bincount(slot - 1, minlength=self.block_size - 1) > 0
        return (weights * self.per_slot(values, slot)).sum() / (weights * present).sum().clamp(min=1e-6)

    def slot_metrics(self, logits: torch.Tensor, rows: BlockRows, **per_row: torch.Tensor) -> dict[str, torch.Tensor]:
        """acc/j (top-1 agreement with the target at slot j) and, for each named per-row value, name/j."""
        metrics = {}
        series = {"acc": (logits.argmax(-1) == rows.teacher_token).float(), **per_row}
        for name, values in series.items():
            for j, value in enumerate(self.per_slot(values.detach(), rows.slot), 1):
                metrics[f"{name}/{j}"] = value
        return metrics

    def loss(self, batch: dict, captured: Captured):
        rows = self.block_rows(batch, captured)
        logits = self.lm_head(rows.hidden)
        loss = divergence(logits, rows.teacher, self.cfg.get("loss", "soft_ce"))
        return self.decayed(loss, rows.slot), self.slot_metrics(logits, rows, loss=loss)

    # ---- serving: one block forward per target forward (ParallelDrafter's chains and trees)

    def new_cache(self, target_cache=None) -> ContextCache:
        return ContextCache(len(self.layers))

    def block_hidden(self, cache: ContextCache, aux: list[torch.Tensor], next_tokens: torch.Tensor) -> torch.Tensor:
        """Add the committed positions to the context, then run the block anchored at the last
        committed token: normed hidden [B, block_size, H]."""
        start = cache.length
        context = self.context(aux)
        positions = torch.arange(start, start + context.shape[1], device=context.device)[None]
        for layer, (k, v) in enumerate(self.context_kv(context, positions)):
            cache.layers[layer].append(k, v)
        cache.last_token = next_tokens[:, -1:]
        anchor = cache.length  # the last committed token's position: the context ends right before it
        positions = torch.arange(anchor, anchor + self.block_size, device=context.device)[None]
        return self.run_block(self.block_tokens(cache.last_token[:, 0]), positions, [(layer.keys, layer.values) for layer in cache.layers])

    @torch.no_grad()
    def extend(self, cache: ContextCache, aux: list[torch.Tensor], next_tokens: torch.Tensor):
        """Returns (the slots' hidden states, logits [B, block_size-1, V_draft] for the tokens after
        the last committed one)."""
        hidden = self.block_hidden(cache, aux, next_tokens)[:, 1:]
        return hidden, self.lm_head(hidden)


def spread_aux_layers(num_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly from 1 to N-3 (DFlash's choice), as layer inputs."""
    low, high = 1, max(num_layers - 3, 1)
    if count <= 1:
        return [high]
    return sorted({round(low + i * (high - low) / (count - 1)) for i in range(count)})

