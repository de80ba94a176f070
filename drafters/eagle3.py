"""EAGLE-3 (Li et al., 2025): a one-layer draft head on fused low/mid/high target features.

Layout and weight names follow the EAGLE-3 heads served by vLLM/speculators and SGLang:
`fc` fuses the hidden states entering three target layers (3H -> H); the decoder layer attends
over concat(norm(token embedding), norm(feature)) (2H wide) with a residual from the feature; a
final norm and an lm_head over the draft vocabulary. Training unrolls K steps, each feeding the
drafter's own output feature back in (training-time test), with loss weight decay^k.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dataclasses import dataclass

from drafters.base import Captured, register
from drafters.config import settings
from drafters.config.settings import above, anything, at_least
from drafters.layers import (DraftCache, DraftLayer, UnrolledAttention, add_fused_head, copy_target_head,
                             draft_layer_config)
from drafters.losses import curriculum, unrolled_distill
from drafters.proposal import StepDrafter


class Eagle3Layer(DraftLayer):
    """The draft decoder layer; `attend(q, k, v)` is TTT attention in training, cached at serving."""

    def __init__(self, config):
        # attention reads [embedding ; feature], hence 2 x width
        super().__init__(config, 2 * config.hidden_size)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)  # on the embedding
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)  # on the feature

    def forward(self, embeds, feature, cos, sin, attend):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], -1)
        return super().forward(x, feature, cos, sin, attend)


@register("eagle3")
class Eagle3(StepDrafter):
    @dataclass
    class Settings(settings.Drafter):
        aux_layers: list[int] | None = at_least(0, distinct=True)
        ttt_steps: int = at_least(1)
        ttt_start: int | None = at_least(1, saved=False)
        loss_decay: float = above(0)
        init_head_from_target: bool = anything(saved=False)
        freeze_head: bool = anything(saved=False)

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        self.layer_config = draft_layer_config(spec)
        self.aux_layers = list(cfg.aux_layers) if cfg.get("aux_layers") else default_aux_layers(spec.num_layers)
        add_fused_head(self, spec, vocab, len(self.aux_layers), self.layer_config)
        self.lm_head.requires_grad_(not cfg.get("freeze_head", False))
        self.midlayer = Eagle3Layer(self.layer_config)

    def capture_layers(self):
        return self.aux_layers

    @classmethod
    def default_steps(cls, hparams):
        return int(hparams["ttt_steps"])  # the unroll it was trained for

    def init_from_target(self, target):
        copy_target_head(self, target)

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(aux, -1).to(self.fc.weight.dtype))

    def loss(self, batch: dict, captured: Captured):
        positions = torch.arange(batch["input_ids"].shape[1], device=batch["input_ids"].device).unsqueeze(0)
        attend = UnrolledAttention()

        def step(k, tokens, feature):  # step k, position t: token t+1+k in, predicts token t+2+k
            cos, sin = self.rotary(feature, positions + k)
            return self.midlayer(self.embed_tokens(tokens), feature, cos, sin, attend)

        unroll = curriculum(int(self.cfg.ttt_steps), self.cfg.get("ttt_start"), self.progress)
        weights = [float(self.cfg.loss_decay) ** k for k in range(unroll)]
        return unrolled_distill(batch, captured, self.fuse(captured.aux), weights, step,
                                head=lambda feature: self.lm_head(self.norm(feature)), kind=self.cfg.get("loss", "soft_ce"))

    # ---- serving: the same layer, run incrementally over a DraftCache (see StepDrafter)

    def step(self, cache: DraftCache, tokens, feature, positions, mask=None):
        cos, sin = self.rotary(feature, positions)
        feature = self.midlayer(self.embed_tokens(tokens), feature, cos, sin, cache.attention(mask))
        return feature, self.lm_head(self.norm(feature))


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high features: inputs of layers 2, N//2 and N-3."""
    return [2, num_layers // 2, num_layers - 3]
