"""Building blocks shared by drafters: a Llama-style layer config derived from the target, and
attention for training-time test (TTT) unrolling."""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig

from drafters.target import TargetSpec


def draft_layer_config(spec: TargetSpec, num_layers: int = 1) -> LlamaConfig:
    """A Llama config with the target's widths, heads and RoPE: the drafter's own decoder layers.

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
        rope_parameters=dict(spec.rope_parameters),
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of TTT step k = len(keys) - 1 over [B, heads, T, D] tensors (kv heads pre-expanded).

    Position t of step k stands for sequence position t + k of a draft chain whose context ends at
    t: it sees step 0 (the target-fed context) causally up to t, plus its own chain entries — the
    same position t of steps 1..k. This is what the drafter sees at serving time, unrolled.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    context = (q @ keys[0].transpose(-1, -2)) * scale
    context = context.masked_fill(~causal, torch.finfo(context.dtype).min)
    chain = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    weights = torch.softmax(torch.cat([context, *chain], -1).float(), -1).to(q.dtype)
    out = weights[..., :length] @ values[0]
    for j, v in enumerate(values[1:]):
        out = out + weights[..., length + j : length + j + 1] * v
    return out
