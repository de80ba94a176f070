"""Gemma-4-style MTP assistant (HF `Gemma4AssistantForCausalLM`): a small separate model that drafts
from the target's KV cache instead of keeping a context of its own.

A draft step reads the last token's embedding and an activation of the target's width: for the first
draft the target's final hidden state before that token, then the assistant's own previous output.
`pre_projection` (2H -> W) over [embedding ; activation] (the order of HF's Gemma 4 candidate
generator), a few decoder layers whose attention has queries of its own but reads the keys and values
the target's last full-attention layer wrote to its KV cache, and `post_projection` (W -> H) give the
next activation, fed to the next step; its logits come through the target's (tied) embedding, frozen.

Every draft step's query sits at the position of the last committed token (Gemma 4 keeps it constant
too) and sees exactly the committed context, so drafting writes no cache at all: a chain and a tree
cost one assistant forward per level, and the tree's nodes are independent of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, repeat_kv

from drafters.base import Captured, register
from drafters.config import settings
from drafters.config.errors import UserError
from drafters.config.settings import above, at_least
from drafters.layers import ContextAttention, TargetNorm, rope
from drafters.losses import normalized_decay, unrolled_distill
from drafters.proposal import StepDrafter
from drafters.target.model import TargetClasses, full_attention_rope, full_attention_rope_parameters


class AssistantAttention(nn.Module):
    """Queries of the assistant's own over the target's keys/values (RoPE'd and, for Gemma, normed)."""

    def __init__(self, config):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps)  # queries on the scale of normed keys
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend: ContextAttention):
        batch, length, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)).transpose(1, 2), cos, sin)
        return self.o_proj(attend(q).transpose(1, 2).reshape(batch, length, -1))


class AssistantLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = AssistantAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, attend: ContextAttention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetContext:
    """The serving state: nothing of its own, a view of the target's KV cache, which the engine keeps
    holding the committed tokens but the last one (the one being extended): `length` of them."""

    def __init__(self, target_cache, layer: int):
        self.target_cache, self.layer, self.length = target_cache, layer, 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keys_values(self):
        layer = self.target_cache.layers[self.layer]
        return layer.keys[..., : self.length, :], layer.values[..., : self.length, :]


class TargetKeysValues:
    """Training only: the keys/values target layer `layer` writes to its KV cache, recomputed from the
    captured input of that layer by the target's own frozen attention (the engine's cache holds the same)."""

    def __init__(self, target, layer: int):
        self.target, self.layer = target, layer

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor):
        decoder_layer = self.target.decoder_layers[self.layer]
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rope = full_attention_rope(self.target.model.model.rotary_emb, hidden, positions)
        cache = DynamicCache()  # what the layer writes to it is what serving reads
        decoder_layer.self_attn(hidden_states=decoder_layer.input_layernorm(hidden), position_embeddings=rope,
                                attention_mask=None, cache=cache)
        return cache.layers[self.layer].keys, cache.layers[self.layer].values


def readable_kv_layer(spec, classes: TargetClasses) -> int:
    """The target layer whose cache the assistant reads: its last full-attention layer, if its keys are
    per-head and fully RoPE'd (what the assistant's queries can attend to); else a one-line UserError."""
    cannot = f"drafter=gemma_mtp reads per-head, fully RoPE'd keys from the target's KV cache; target {spec.name} ({spec.model_type})"
    if spec.hf_config.get("kv_lora_rank"):
        raise UserError(f"{cannot} caches multi-head latent attention (a compressed KV), which it cannot read")
    rope = full_attention_rope_parameters(spec.hf_config.get("rope_parameters") or {})
    partial = float(rope.get("partial_rotary_factor") or spec.hf_config.get("partial_rotary_factor") or 1.0)
    if partial < 1.0:
        raise UserError(f"{cannot} rotates only part of each key (partial_rotary_factor={partial})")
    if not classes.full_attention_layers:
        raise UserError(f"{cannot} has no full-attention layer (sliding-window or linear attention only)")
    return classes.full_attention_layers[-1]


@register("gemma_mtp")
class GemmaMTP(StepDrafter):
    @dataclass
    class Settings(settings.Drafter):
        ttt_steps: int = at_least(1)
        loss_decay: float = above(0)
        hidden_size: int | None = at_least(1)
        intermediate_size: int | None = at_least(1)
        num_layers: int = at_least(1)
        num_heads: int | None = at_least(1)

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        classes = TargetClasses(spec)
        self.kv_layer = readable_kv_layer(spec, classes)
        # the sizes left null take the target's (half its width), and are saved as resolved
        self.hidden_size = width = int(cfg.get("hidden_size") or spec.hidden_size // 2)
        self.num_heads = heads = int(cfg.get("num_heads") or spec.num_heads)
        self.intermediate_size = int(cfg.get("intermediate_size") or spec.intermediate_size * width // spec.hidden_size)
        if heads % spec.num_kv_heads:
            raise UserError(f"drafter.num_heads={heads}: must be a multiple of the target's {spec.num_kv_heads} KV heads")
        if width % heads:
            raise UserError(f"drafter.hidden_size={width}: must be a multiple of its {heads} attention heads "
                            "(drafter.num_heads, default the target's)")
        self.assistant_config = LlamaConfig(
            hidden_size=width,
            intermediate_size=self.intermediate_size,
            num_attention_heads=heads,
            head_dim=spec.head_dim,  # the target's: queries meet its keys
            num_hidden_layers=int(cfg.num_layers),
            rms_norm_eps=spec.rms_norm_eps,
            hidden_act="silu",
        )
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size).requires_grad_(False)
        self.register_buffer("embed_scale", torch.tensor(1.0), persistent=True)  # Gemma's sqrt(H) embedding scale
        self.target_norm = TargetNorm(spec)  # the captured last-layer output -> the target's final hidden state
        self.pre_projection = nn.Linear(2 * spec.hidden_size, width, bias=False)
        self.layers = nn.ModuleList(AssistantLayer(self.assistant_config) for _ in range(int(cfg.num_layers)))
        self.norm = LlamaRMSNorm(width, spec.rms_norm_eps)
        self.post_projection = nn.Linear(width, spec.hidden_size, bias=False)
        self.lm_head = nn.Linear(spec.hidden_size, vocab.draft_size, bias=False).requires_grad_(False)
        self.rotary = classes.rotary(classes.config)  # the target's own RoPE, as its keys carry it
        self.target_keys_values = None  # set by init_from_target: training reads the target's K/V through it

    def capture_layers(self):
        # the input of the cache layer (training recomputes its K/V) and the last layer's output (the activation)
        return [self.kv_layer, self.spec.num_layers]

    @torch.no_grad()
    def init_from_target(self, target):
        attention = target.decoder_layers[self.kv_layer].self_attn
        key_width = getattr(getattr(attention, "k_proj", None), "out_features", None)
        if key_width != self.spec.num_kv_heads * self.spec.head_dim:
            raise UserError(f"drafter=gemma_mtp: target {self.spec.name} layer {self.kv_layer} has no per-head "
                            f"k_proj of {self.spec.num_kv_heads} x {self.spec.head_dim} whose cached keys it could read")
        embedding = target.model.get_input_embeddings()
        self.embed_tokens.weight.copy_(embedding.weight.float())
        self.embed_scale.fill_(float(getattr(embedding, "embed_scale", 1.0)))
        self.lm_head.weight.copy_(target.lm_head_weight[self.vocab.draft_ids].float())
        self.target_norm.copy_from(target)
        self.target_keys_values = TargetKeysValues(target, self.kv_layer)

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.target_norm(aux[-1].to(self.pre_projection.weight.dtype))

    def target_attention(self, keys, values, causal: bool) -> ContextAttention:
        """The assistant's queries over the target's cached keys/values (kv heads expanded to its own)."""
        groups = self.assistant_config.num_attention_heads // keys.shape[1]
        return ContextAttention(repeat_kv(keys, groups), repeat_kv(values, groups), causal=causal)

    def assist(self, tokens, activation, cos, sin, attend: ContextAttention):
        """The next activation (target width) from each token and the activation before it."""
        embeds = self.embed_tokens(tokens) * self.embed_scale
        x = self.pre_projection(torch.cat([embeds, activation], -1))
        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return self.post_projection(self.norm(x))

    def loss(self, batch: dict, captured: Captured):
        if self.target_keys_values is None:
            raise RuntimeError("gemma_mtp trains on its target's keys/values: build it with build_drafter(cfg, target, vocab)")
        keys, values = self.target_keys_values(captured.aux[0])
        # row t drafts after token t+1 at every step: its query sits at t+1 and sees the target's K/V up to t
        positions = torch.arange(1, batch["input_ids"].shape[1] + 1, device=keys.device).unsqueeze(0)
        cos, sin = full_attention_rope(self.rotary, keys, positions)
        weights = normalized_decay(float(self.cfg.loss_decay), int(self.cfg.ttt_steps))
        attend = self.target_attention(keys, values, causal=True)
        return unrolled_distill(batch, captured, self.fuse(captured.aux), weights,
                                step=lambda k, tokens, activation: self.assist(tokens, activation, cos, sin, attend),
                                head=self.draft_logits, kind=self.cfg.get("loss", "soft_ce"))

    # ---- serving: the engine's StepDrafter loop, over the target's cache

    def new_cache(self, target_cache=None) -> TargetContext:
        if target_cache is None:
            raise ValueError("gemma_mtp drafts from the target's KV cache: new_cache needs it")
        return TargetContext(target_cache, self.kv_layer)

    @torch.no_grad()
    def extend(self, cache: TargetContext, aux: list[torch.Tensor], next_tokens: torch.Tensor):
        """The context entries are the target's own: count them, and draft from the last one."""
        cache.length += next_tokens.shape[1]
        feature = self.step(cache, next_tokens[:, -1:], self.fuse([state[:, -1:] for state in aux]))
        return feature, self.draft_logits(feature)

    def step(self, cache: TargetContext, tokens, feature, positions=None, mask=None):
        # StepDrafter's positions and tree mask are moot: every query sits at the last committed token's
        # position and sees the committed context only (tree nodes never see each other)
        keys, values = cache.keys_values()
        cos, sin = full_attention_rope(self.rotary, feature, torch.full_like(tokens, cache.length))
        return self.assist(tokens, feature, cos, sin, self.target_attention(keys, values, causal=False))

    def draft_logits(self, feature):
        return self.lm_head(feature)
