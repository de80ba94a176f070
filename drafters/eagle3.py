"""EAGLE-3 (Li et al., 2025): a one-layer draft head on fused low/mid/high target features.

Layout and weight names follow the EAGLE-3 heads served by vLLM/speculators and SGLang:
`fc` fuses the hidden states entering three target layers (3H -> H); the decoder layer attends
over concat(norm(token embedding), norm(feature)) (2H wide) with a residual from the feature; a
final norm and an lm_head over the draft vocabulary. Training unrolls K steps, each feeding the
drafter's own output feature back in (training-time test), with loss weight decay^k.

Two options from later recipes: `fc_norm` (EAGLE 3.1, speculators' flag of that name) norms each
target state before `fc`; `init_layer_from_target` starts the decoder layer from the target's last
one (its attention reads the feature half of [embedding ; feature]): by default wherever that layer
is Llama-shaped.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dataclasses import dataclass

from drafters.base import Captured, register
from drafters.config import settings
from drafters.config.errors import UserError
from drafters.config.settings import above, anything, at_least
from drafters.layers import (DraftCache, DraftLayer, UnrolledAttention, add_fused_head, copy_target_head,
                             draft_layer_config)
from drafters.losses import curriculum, unrolled_distill
from drafters.proposal import StepDrafter


# a Llama decoder layer's weights: what `init_layer_from_target` copies from (no biases, no q/k norms)
LLAMA_LAYER = {f"{part}.weight" for part in ("input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                                              "mlp.down_proj", *(f"self_attn.{p}_proj" for p in "qkvo"))}


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
        init_layer_from_target: bool | None = anything(saved=False)
        freeze_head: bool = anything(saved=False)
        fc_norm: bool = anything()
        feature_noise: float = at_least(0, saved=False)

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        self.layer_config = draft_layer_config(spec)
        self.aux_layers = list(cfg.aux_layers) if cfg.get("aux_layers") else default_aux_layers(spec.num_layers)
        add_fused_head(self, spec, vocab, len(self.aux_layers), self.layer_config)
        self.fc_norm = nn.ModuleList([LlamaRMSNorm(spec.hidden_size, spec.rms_norm_eps) for _ in self.aux_layers]
                                     if cfg.get("fc_norm") else [])
        self.lm_head.requires_grad_(not cfg.get("freeze_head", False))
        self.midlayer = Eagle3Layer(self.layer_config)

    def capture_layers(self):
        return self.aux_layers

    def init_from_target(self, target):
        copy_target_head(self, target)
        wanted = self.cfg.get("init_layer_from_target")
        if wanted or (wanted is None and self.fits_target_layer(target)):
            self.warm_start_layer(target)

    def fits_target_layer(self, target) -> bool:
        return (set(target.decoder_layers[-1].state_dict()) == LLAMA_LAYER
                and self.spec.hf_config.get("hidden_act", "silu") == "silu")

    @torch.no_grad()
    def warm_start_layer(self, target):
        """The target's last decoder layer as the draft layer: its MLP, output projection and norms as
        they are; its query/key/value weights on the feature half of the 2H input (the embedding half
        starts at zero, so at first the layer reads the feature alone); `fc` starts as the identity on
        the highest target state."""
        last = target.decoder_layers[-1]
        if not self.fits_target_layer(target):
            raise UserError(f"drafter.init_layer_from_target: the last layer of target {self.spec.name} "
                            f"({self.spec.model_type}) is not a Llama layer, so it does not fit the draft layer")
        width = self.spec.hidden_size
        for name in ("mlp", "post_attention_layernorm", "self_attn.o_proj"):
            self.midlayer.get_submodule(name).load_state_dict(last.get_submodule(name).state_dict())
        self.midlayer.hidden_norm.load_state_dict(last.input_layernorm.state_dict())
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = self.midlayer.self_attn.get_submodule(name).weight
            weight.zero_()
            weight[:, width:] = last.self_attn.get_submodule(name).weight
        self.fc.weight.zero_()
        self.fc.weight[:, -width:] = torch.eye(width)

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        aux = [a.to(self.fc.weight.dtype) for a in aux]
        if self.fc_norm:
            aux = [norm(a) for norm, a in zip(self.fc_norm, aux)]
        return self.fc(torch.cat(aux, -1))

    def loss(self, batch: dict, captured: Captured):
        positions = torch.arange(batch["input_ids"].shape[1], device=batch["input_ids"].device).unsqueeze(0)
        attend = UnrolledAttention()

        def step(k, tokens, feature):  # step k, position t: token t+1+k in, predicts token t+2+k
            cos, sin = self.rotary(feature, positions + k)
            return self.midlayer(self.embed_tokens(tokens), feature, cos, sin, attend)

        unroll = curriculum(int(self.cfg.ttt_steps), self.cfg.get("ttt_start"), self.progress)
        weights = [float(self.cfg.loss_decay) ** k for k in range(unroll)]
        feature = self.fuse(captured.aux)
        if self.training and self.cfg.get("feature_noise"):  # uniform, in units of each vector's RMS (EAGLE's, scaled)
            scale = feature.detach().pow(2).mean(-1, keepdim=True).sqrt() * float(self.cfg.feature_noise)
            feature = feature + (torch.rand_like(feature) - 0.5) * scale
        return unrolled_distill(batch, captured, feature, weights, step,
                                head=self.draft_logits, kind=self.cfg.get("loss", "soft_ce"))

    # ---- serving: the same layer, run incrementally over a DraftCache (see StepDrafter)

    def step(self, cache: DraftCache, tokens, feature, positions, mask=None):
        cos, sin = self.rotary(feature, positions)
        return self.midlayer(self.embed_tokens(tokens), feature, cos, sin, cache.attention(mask))

    def draft_logits(self, feature):
        return self.lm_head(self.norm(feature))


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high features: inputs of layers 2, N//2 and N-3."""
    return [2, num_layers // 2, num_layers - 3]
