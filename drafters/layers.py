"""Building blocks shared by drafters: a Llama-style layer config derived from the target, the
draft decoder layer (attention + MLP), a frozen copy of the target's final norm, the preallocated KV
storage of drafters' caches (and of the target's when it decodes a batch), and attention.

Attention is one protocol: a layer computes its queries, keys and values [B, heads, T, D] (kv heads
expanded) and hands them to an `attend(q, k, v)`, which decides what they see: UnrolledAttention in
training (TTT), CachedAttention at serving (a DraftCache), ContextAttention over a fixed context
(DFlash's block, gemma_mtp over the target's cache). HF decoder layers reach it through the
AttentionInterface of drafters/mtp.py."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, repeat_kv, rotate_half

from drafters.target.model import Target, TargetSpec, full_attention_rope_parameters


def draft_layer_config(spec: TargetSpec, num_layers: int = 1) -> LlamaConfig:
    """A Llama config with the target's widths, heads and RoPE: the drafter's own decoder layers.
    They attend over the whole draft context, so they rotate like the target's full-attention
    layers (on Gemma 3: its full-attention RoPE, not the sliding-window layers' local base).

    The same config is what vLLM/SGLang read as the draft model's `transformer_layer_config`.
    """
    return LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_hidden_layers=num_layers,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters=full_attention_rope_parameters(spec.rope_parameters),
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, heads, T, D] with the rotary embedding's [B, T, D] cos/sin (Llama's rotation)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DraftAttention(nn.Module):
    """Llama attention over `input_size`-wide inputs (EAGLE-3: [embedding ; feature], 2H; EAGLE-1: H).
    `project` gives the queries/keys/values; the caller's `attend(q, k, v)` decides what they see.
    `qk_norm`: Qwen3's per-head RMSNorm on queries and keys before RoPE (the DFlash layer's)."""

    def __init__(self, config, input_size: int, qk_norm: bool = False):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.heads, self.kv_heads = config.head_dim, heads, kv_heads
        self.q_proj = nn.Linear(input_size, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v as [B, heads, T, D] with RoPE applied and kv heads expanded."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        k, v = self.keys_values(x, cos, sin)
        q = rope(q.transpose(1, 2), cos, sin)
        return q, k, v

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """k, v alone as [B, heads, T, D] (RoPE applied, kv heads expanded): what a context of
        features contributes to attention (DFlash's target context)."""
        batch, length, _ = x.shape
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        k = rope(k.transpose(1, 2), cos, sin)
        groups = self.heads // self.kv_heads
        return repeat_kv(k, groups), repeat_kv(v, groups)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))


class DraftLayer(nn.Module):
    """A draft decoder layer without an input norm of its own: `residual + attention(x)`, then the
    MLP block. Drafters prepare `x` (EAGLE-3 norms and concatenates two inputs; EAGLE-1's first
    layer takes fc's output as is)."""

    def __init__(self, config, input_size: int, qk_norm: bool = False):
        super().__init__()
        self.self_attn = DraftAttention(config, input_size, qk_norm)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, residual, cos, sin, attend):
        h = residual + self.self_attn.output(attend(*self.self_attn.project(x, cos, sin)))
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetNorm(LlamaRMSNorm):
    """A frozen copy of the target's final norm: turns the last layer's output (aux layer id N) into
    the normed hidden state the target's lm_head reads, which is what EAGLE-1 extrapolates and
    Medusa heads read. Kept in the drafter's weights so an artifact serves without the target's."""

    def __init__(self, spec: TargetSpec):
        super().__init__(spec.hidden_size, spec.rms_norm_eps)
        self.requires_grad_(False)

    @torch.no_grad()
    def copy_from(self, target: Target) -> None:
        norm = target.model.model.norm
        weight = norm.weight.float()
        # store the scale itself: Llama's norm scales by weight, Gemma's and Qwen3-Next's by 1 + weight,
        # which a vector of ones tells apart (normed, it is scale / sqrt(1 + eps))
        scale = norm(torch.ones_like(weight)).float() * math.sqrt(1 + self.variance_epsilon)
        offset = 1.0 if (scale - weight - 1).abs().max() < (scale - weight).abs().max() else 0.0
        self.weight.copy_(weight + offset)


def add_fused_head(drafter: nn.Module, spec: TargetSpec, vocab, inputs: int, layer_config) -> None:
    """What EAGLE-3 and DFlash both hold around their decoder layers: the target's token embedding
    (frozen), `fc` fusing `inputs` target hidden states (inputs x H -> H), the final norm and lm_head
    over the draft vocabulary and the RoPE of `layer_config`."""
    width = spec.hidden_size
    drafter.embed_tokens = nn.Embedding(spec.vocab_size, width).requires_grad_(False)
    drafter.fc = nn.Linear(inputs * width, width, bias=False)
    drafter.norm = LlamaRMSNorm(width, spec.rms_norm_eps)
    drafter.lm_head = nn.Linear(width, vocab.draft_size, bias=False)
    drafter.rotary = LlamaRotaryEmbedding(layer_config)


@torch.no_grad()
def copy_target_head(drafter: nn.Module, target: Target) -> None:
    """The drafter's frozen token embedding, and (unless `init_head_from_target: false`) a warm start
    of its final norm + lm_head: the target's own, on the draft vocabulary's rows."""
    drafter.embed_tokens.weight.copy_(target.embed_weight.float())
    if drafter.cfg.get("init_head_from_target", True):
        drafter.lm_head.weight.copy_(target.lm_head_weight[drafter.vocab.draft_ids].float())
        drafter.norm.weight.copy_(target.model.model.norm.weight.float())


class KVBuffer:
    """Keys and values [B, heads, L, D] in preallocated storage written by position (gpt-fast's
    KVCache): an append copies only the new entries, a crop only moves the end; the storage doubles
    when it fills."""

    def __init__(self):
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[..., : self.length, :]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[..., : self.length, :]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        start, end = self.length, self.length + k.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            capacity = max(2 * end, 256)
            keys, values = (new.new_empty(*new.shape[:-2], capacity, new.shape[-1]) for new in (k, v))
            if start:
                keys[..., :start, :], values[..., :start, :] = self.keys, self.values
            self._keys, self._values = keys, values
        self._keys[..., start:end, :], self._values[..., start:end, :] = k, v
        self.length = end

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (one copy of the storage)."""
        self._keys, self._values = self._keys[rows], self._values[rows]


class BufferedLayer(DynamicLayer):
    """A transformers cache layer over a KVBuffer: `DynamicCache` concatenates every layer's whole
    cache at every token (measured: a third of a batch-64 decoding step of SmolLM2 at context
    400); this writes only the new entries. `Cache(layer_class_to_replicate=BufferedLayer)`."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.buffer, self.is_initialized = key_states.device, KVBuffer(), True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.buffer.append(key_states, value_states)
        self.keys, self.values = self.buffer.keys, self.buffer.values
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.buffer.select(indices)
            self.keys, self.values = self.buffer.keys, self.buffer.values

    def crop(self, tokens_to_remove: int) -> None:  # transformers 5: a negative count from the end
        if self.is_initialized:
            self.buffer.crop(self.buffer.length + min(tokens_to_remove, 0))
            self.keys, self.values = self.buffer.keys, self.buffer.values


class DraftCache(KVBuffer):
    """A drafter's own KV cache at serving time, cropped after each verification to the entries
    backed by accepted tokens."""

    def attention(self, mask: torch.Tensor | None = None) -> CachedAttention:
        """The `attend` of one draft step over this cache (tree drafting: `mask` [new, total], True = visible)."""
        return CachedAttention(self, mask)


class CachedAttention:
    """A serving step's `attend`: the step's keys/values are appended to the cache, then its queries
    see the whole cache, causally or under the tree mask."""

    def __init__(self, cache: KVBuffer, mask: torch.Tensor | None = None):
        self.cache, self.mask = cache, mask

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, mask = self.cache.length, self.mask
        self.cache.append(k, v)
        if mask is None and q.shape[-2] > 1:  # one query sees every entry: no mask needed
            mask = torch.ones(q.shape[-2], self.cache.length, dtype=torch.bool, device=q.device).tril(start)
        return torch.nn.functional.scaled_dot_product_attention(q, self.cache.keys, self.cache.values, attn_mask=mask)


class ContextAttention:
    """The `attend` of queries over a fixed context (a block drafter's target context, the target's own
    cache) followed by their own keys/values if any: under `mask` [.., Q, context + Q] (True = visible),
    causally (`causal`, queries and context aligned), or all of it."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False):
        self.keys, self.values, self.mask, self.causal = keys, values, mask, causal

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        keys, values = self.keys.to(q.dtype), self.values.to(q.dtype)
        if k is not None:
            keys, values = torch.cat([keys, k], -2), torch.cat([values, v], -2)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, is_causal=self.causal)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _ContextChainAttention(torch.autograd.Function):
    """TTT attention (see `ttt_attention`) without the [T, T] score matrix: the causal context part runs in
    PyTorch's fused CPU flash kernel, the k chain keys per position are merged in through the
    log-sum-exp, and the backward hands the flash kernel the merged output and log-sum-exp (the
    ring-attention identity), so no gradient ever needs the context-only normalizer."""

    @staticmethod
    def forward(ctx, q, k0, v0, chain_k, chain_v):  # chain_*: [B, heads, T, k, D]
        scale = 1.0 / math.sqrt(q.shape[-1])
        out0, lse0 = _flash_cpu(q, k0, v0, 0.0, True, scale=scale)
        scores = (q.unsqueeze(-2) * chain_k).sum(-1).float() * scale  # [B, heads, T, k]
        lse = torch.logaddexp(lse0, torch.logsumexp(scores, -1))
        context_weight = torch.exp(lse0 - lse).unsqueeze(-1)
        chain_weight = torch.exp(scores - lse.unsqueeze(-1))
        out = (context_weight * out0.float() + (chain_weight.unsqueeze(-1) * chain_v.float()).sum(-2)).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, chain_k, chain_v, out, lse, chain_weight)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, chain_k, chain_v, out, lse, chain_weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q, grad_k0, grad_v0 = _flash_cpu_backward(grad_out, q, k0, v0, out, lse, 0.0, True, scale=ctx.scale)
        grad = grad_out.float()
        row = (grad * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O)
        grad_scores = chain_weight * ((grad.unsqueeze(-2) * chain_v.float()).sum(-1) - row) * ctx.scale
        grad_q = grad_q + (grad_scores.unsqueeze(-1) * chain_k.float()).sum(-2).to(q.dtype)
        grad_chain_k = (grad_scores.unsqueeze(-1) * q.float().unsqueeze(-2)).to(chain_k.dtype)
        grad_chain_v = (chain_weight.unsqueeze(-1) * grad.unsqueeze(-2)).to(chain_v.dtype)
        return grad_q, grad_k0, grad_v0, grad_chain_k, grad_chain_v


def ttt_attention_merged(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """TTT attention as one fused attention call (GPUs: PyTorch's memory-efficient or
    cuDNN kernel, CUDA and ROCm alike): every (step, position) is a key of its own, and the mask
    shows step 0 causally and steps >= 1 on the diagonal. Its [T, T * steps] scores are computed in
    tiles, never stored."""
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=q.device)
    mask = torch.cat([causal, *[diagonal] * (len(keys) - 1)], -1)
    return torch.nn.functional.scaled_dot_product_attention(q, torch.cat(keys, -2), torch.cat(values, -2), attn_mask=mask)


class UnrolledAttention:
    """The `attend` of a training-time-test unroll: each call (one per step) adds that step's keys and
    values, and its queries see the target-fed context causally and the chain's own entries at t."""

    def __init__(self):
        self.keys, self.values = [], []

    def __call__(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        self.keys.append(key)
        self.values.append(value)
        return ttt_attention(q, self.keys, self.values)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of TTT step k = len(keys) - 1 over [B, heads, T, D] tensors (kv heads pre-expanded).
    Position t of step k stands for sequence position t + k of a draft chain whose context ends at
    t: it sees step 0 (the target-fed context) causally up to t, plus its own chain entries, the
    same position t of steps 1..k; this is what the drafter sees at serving time, unrolled.

    Through a fused kernel: on CPU the flash kernel with the chain merged in by log-sum-exp (no
    [T, T] scores), elsewhere one masked attention call (tests/test_eagle3.py holds the plain
    reference both are checked against)."""
    if q.device.type != "cpu":
        return ttt_attention_merged(q, keys, values)
    if len(keys) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
    return _ContextChainAttention.apply(
        q.contiguous(), keys[0].contiguous(), values[0].contiguous(),
        torch.stack(keys[1:], -2), torch.stack(values[1:], -2),
    )
