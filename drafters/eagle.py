"""EAGLE-1 (Li et al., 2024): extrapolate the target's top-layer feature one token ahead.

At position t the head reads f_t, the target's final (normed) hidden state, and the embedding of
the token at t+1; `fc` fuses them (2H -> H), one Llama decoder layer (without input norm, as in
EAGLE's first layer) turns that into a prediction of f_{t+1}, and the target's own frozen lm_head
reads the prediction as the distribution of token t+2. Loss: SmoothL1 to the real f_{t+1} plus
0.1 x cross-entropy against the target's distribution there, with uniform noise on the input
features so the head tolerates its own slightly-off features when it drafts from them (a chain or
the EAGLE-2 dynamic tree, see drafters/proposal.py).

Weight names follow the EAGLE repo's heads as vLLM (`method=eagle`) and SGLang (`EAGLE`) load
them (`fc`, a Llama layer), `midlayer` standing for their `layers.0` (export renames it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from drafters.base import Captured, register
from drafters.config import settings
from drafters.config.settings import anything, at_least
from drafters.layers import DraftCache, DraftLayer, TargetNorm, UnrolledAttention, draft_layer_config
from drafters.losses import distill, trained_positions
from drafters.proposal import StepDrafter


@register("eagle")
class Eagle(StepDrafter):
    @dataclass
    class Settings(settings.Drafter):
        feature_noise: float = at_least(0)
        feature_weight: float = at_least(0)
        token_weight: float = at_least(0)
        fc_bias: bool = anything()

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        width = spec.hidden_size
        self.layer_config = draft_layer_config(spec)
        self.embed_tokens = nn.Embedding(spec.vocab_size, width).requires_grad_(False)
        # vLLM's EAGLE-1 fc has no bias; the EAGLE repo's and SGLang's have one (fc_bias: heads imported from them)
        self.fc_bias = bool(cfg.get("fc_bias", False))
        self.fc = nn.Linear(2 * width, width, bias=self.fc_bias)
        self.midlayer = DraftLayer(self.layer_config, width)
        self.lm_head = nn.Linear(width, vocab.draft_size, bias=False).requires_grad_(False)  # the target's
        self.target_norm = TargetNorm(spec)
        self.rotary = LlamaRotaryEmbedding(self.layer_config)

    def capture_layers(self):
        # the last layer's output: `target_norm` makes it the feature f_t
        return [self.spec.num_layers]

    @classmethod
    def default_steps(cls, hparams):
        return 3  # no trained length: deeper drafts were almost never accepted (docs/results.md)

    @torch.no_grad()
    def init_from_target(self, target):
        self.embed_tokens.weight.copy_(target.embed_weight.float())
        self.lm_head.weight.copy_(target.lm_head_weight[self.vocab.draft_ids].float())
        self.target_norm.copy_from(target)

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.target_norm(aux[0].to(self.fc.weight.dtype))

    def extrapolate(self, tokens, feature, positions, attend):
        """The predicted next features from features [B, T, H] and the tokens [B, T] that follow them."""
        cos, sin = self.rotary(feature, positions)
        x = self.fc(torch.cat([self.embed_tokens(tokens), feature], -1))
        return self.midlayer(x, x, cos, sin, attend)

    def loss(self, batch: dict, captured: Captured):
        input_ids = batch["input_ids"]
        length = input_ids.shape[1]
        feature = self.fuse(captured.aux)
        noisy = feature
        if self.training:
            noisy = feature + (torch.rand_like(feature) - 0.5) * float(self.cfg.feature_noise)
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        # one step of an unroll: causal attention over the sequence
        predicted = self.extrapolate(F.pad(input_ids[:, 1:], (0, 1)), noisy, positions, UnrolledAttention())
        # position t predicts f_{t+1}, and through lm_head the teacher at t+1 (token t+2)
        rows = trained_positions(batch, captured)[:, 1:]
        predicted = predicted[:, :-1][rows].float()
        feature_loss = F.smooth_l1_loss(predicted, feature[:, 1:][rows].float(), reduction="none").mean(-1)
        feature_loss = feature_loss.sum() / rows.sum().clamp(min=1)
        teacher = torch.softmax(captured.teacher_logits[:, 1:][rows].float(), -1)
        token_loss, accuracy = distill(self.draft_logits(predicted), teacher, captured.teacher_token[:, 1:][rows],
                                       self.cfg.get("loss", "soft_ce"))
        total = float(self.cfg.feature_weight) * feature_loss + float(self.cfg.token_weight) * token_loss
        return total, {"acc/1": accuracy, "loss/feature": feature_loss.detach(), "loss/token": token_loss.detach()}

    # ---- serving (StepDrafter): one extrapolation step per call, keys/values kept in a DraftCache

    def step(self, cache: DraftCache, tokens, feature, positions, mask=None):
        return self.extrapolate(tokens, feature, positions, cache.attention(mask))

    def draft_logits(self, feature):
        return self.lm_head(feature)
