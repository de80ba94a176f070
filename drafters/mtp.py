"""Multi-token prediction, DeepSeek-V3 style: trained from scratch, or fine-tuned from the MTP module a
target's checkpoint ships.

The module at position t: RMSNorm of the target's final hidden state at t (`hnorm`) and of the
embedding of token t+1 (`enorm`), `eh_proj` (2H -> H) over [embedding ; hidden state], one transformer
block of the target's own architecture (its decoder-layer class: MLA + MoE for DeepSeek-V3, gated
attention + MoE for Qwen3-Next, Gemma's or Llama's layer otherwise), then a final norm and the target's
lm_head (frozen) give the distribution of token t+2. Chained for k > 1 by feeding the block's output
back as the hidden state (one module, as vLLM and SGLang chain a single native MTP layer), trained by
training-time-test unrolling so each step sees what it sees when drafting, with step weights
0.6^(k-1), normalized (FastMTP).

Two modes:
(a) from scratch (`native_mtp: false`, Llama, Gemma, Qwen, ...): the block starts as a copy of the
    target's last full-attention layer, the final norm is the target's (frozen);
(b) `native_mtp: true`: the module is read from the target's safetensors in one of the LAYOUTS of
    drafters/storage/mtp_layouts.py, fine-tuned, and `export.run format=target_mtp` writes it back
    under the same keys, so an engine's native MTP path (vLLM/SGLang `deepseek_mtp`,
    `qwen3_next_mtp`) serves the fine-tuned weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import repeat_kv

from drafters.base import Captured, register
from drafters.config import settings
from drafters.config.errors import UserError
from drafters.config.settings import above, anything, at_least
from drafters.layers import DraftCache, TargetNorm, UnrolledAttention
from drafters.losses import normalized_decay, unrolled_distill
from drafters.proposal import StepDrafter
from drafters.storage.mtp_layouts import LAYOUTS, NativeLayout, safetensors_reader
from drafters.target.model import TargetClasses, full_attention_rope

ATTENTION = "specdraft_mtp"


def block_attention(module, query, key, value, attention_mask, scaling=None, attend=None, **_):
    """The MTP block's attention (its config's `_attn_implementation`): the HF module computes q, k, v
    its own way (MLA, gated heads, q/k norms), `attend(q, k, v)` decides what they see: TTT attention
    in training, a DraftCache's at serving."""
    width = value.shape[-1]
    # attend() scales by 1/sqrt(head size): the module's own scale (Gemma's, MLA's) goes into q
    query = query * (scaling * query.shape[-1] ** 0.5)
    # MLA's values are narrower than its keys: padded (as HF's flash path does) for the fused kernels
    value = F.pad(value, (0, query.shape[-1] - width))
    groups = module.num_key_value_groups
    out = attend(query, repeat_kv(key, groups), repeat_kv(value, groups))
    return out[..., :width].transpose(1, 2), None


AttentionInterface.register(ATTENTION, block_attention)


@register("mtp")
class MTP(StepDrafter):
    @dataclass
    class Settings(settings.Drafter):
        ttt_steps: int = at_least(1)
        loss_decay: float = above(0)
        native_mtp: bool = anything(saved=False)  # native_layout records what it read
        native_layout: str | None = anything()

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        classes = TargetClasses(spec)
        width, eps, layers = spec.hidden_size, spec.rms_norm_eps, spec.num_layers
        self.native_layout = cfg.get("native_layout")  # the checkpoint layout it was read from, if any
        # the block: one more layer after the target's last, with full attention, attending through `attend`
        changes = {"num_hidden_layers": layers + 1}
        if spec.hf_config.get("layer_types"):
            changes["layer_types"] = ["full_attention"] * (layers + 1)
        config = classes.configured(**changes)
        config._attn_implementation, config._experts_implementation = ATTENTION, "eager"
        self.embed_tokens = nn.Embedding(spec.vocab_size, width).requires_grad_(False)
        self.target_norm = TargetNorm(spec)  # the captured last-layer output -> the target's final hidden state
        self.enorm, self.hnorm = classes.norm(width, eps), classes.norm(width, eps)
        self.eh_proj = nn.Linear(2 * width, width, bias=False)
        self.block = classes.decoder_layer(config, layers)
        self.norm = classes.norm(width, eps).requires_grad_(False)
        self.lm_head = nn.Linear(width, vocab.draft_size, bias=False).requires_grad_(False)
        self.rotary = classes.rotary(config)

    def capture_layers(self):
        return [self.spec.num_layers]  # the last layer's output, normed by `target_norm`

    @torch.no_grad()
    def init_from_target(self, target):
        self.embed_tokens.weight.copy_(target.embed_weight.float())
        self.lm_head.weight.copy_(target.lm_head_weight[self.vocab.draft_ids].float())
        self.target_norm.copy_from(target)
        self.norm.load_state_dict(target.model.model.norm.state_dict())
        full = TargetClasses(self.spec).full_attention_layers
        if not full:
            raise UserError(f"drafter=mtp: target {self.spec.name} has no full-attention layer to start the MTP block from")
        self.block.load_state_dict(target.decoder_layers[full[-1]].state_dict())
        if self.cfg.get("native_mtp"):
            self.native_layout = self.load_native(target.model.name_or_path, f"target {self.spec.name}").name

    @torch.no_grad()
    def load_native(self, directory: str, what: str) -> NativeLayout:
        """Our module from an MTP checkpoint in one of the LAYOUTS (a target's own, or what
        format=target_mtp wrote); a one-line UserError if there is none."""
        if not os.path.isdir(directory or ""):
            raise UserError(f"drafter.native_mtp reads the MTP module from the safetensors of {what}, which was not "
                            f"loaded from a local HF dir ({directory or 'a random init'}): set target.path=<that dir>")
        keys, read = safetensors_reader(directory)
        layers = self.spec.num_layers
        layout = next((layout for layout in LAYOUTS if layout.key("eh_proj.weight", layers) in keys), None)
        if layout is None:
            looked_for = " or ".join(f"{layout.key('eh_proj.weight', layers)} ({layout.name})" for layout in LAYOUTS)
            raise UserError(f"drafter.native_mtp: {what} ({directory}) has no MTP weights "
                            f"(looked for {looked_for} in its *.safetensors)")
        if any(key.startswith(layout.prefix.format(N=layers)) and key.endswith("_scale_inv") for key in keys):
            raise UserError(f"drafter.native_mtp: {what} ({directory}) keeps its MTP weights in FP8 blocks "
                            "(*_scale_inv); dequantize the checkpoint to bf16 first")
        if "lm_head" in layout.names and self.vocab.draft_size != self.spec.vocab_size:
            raise UserError(f"drafter.native_mtp: the {layout.name} MTP module has its own full-vocabulary head; "
                            f"set drafter.draft_vocab_size={self.spec.vocab_size} (the target's vocabulary)")
        expected = {name: tensor for name, tensor in self.state_dict().items() if layout.owns(name)}
        self.load_state_dict(layout.from_checkpoint(read, expected, layers), strict=False)
        return layout

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.target_norm(aux[0].to(self.eh_proj.weight.dtype))

    def predict(self, tokens, hidden, positions, attend):
        """The block's output at each position, from the token after it and the hidden state there."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(tokens)), self.hnorm(hidden)], -1))
        return self.block(x, position_embeddings=full_attention_rope(self.rotary, x, positions), attend=attend)

    def loss(self, batch: dict, captured: Captured):
        positions = torch.arange(batch["input_ids"].shape[1], device=batch["input_ids"].device).unsqueeze(0)
        attend = UnrolledAttention()  # step k at t sees the target-fed context up to t and its own chain at t
        weights = normalized_decay(float(self.cfg.loss_decay), int(self.cfg.ttt_steps))
        return unrolled_distill(batch, captured, self.fuse(captured.aux), weights,
                                step=lambda k, tokens, hidden: self.predict(tokens, hidden, positions + k, attend),
                                head=self.draft_logits, kind=self.cfg.get("loss", "soft_ce"))

    # ---- serving: the same block, run incrementally over a DraftCache (see StepDrafter)

    def step(self, cache: DraftCache, tokens, feature, positions, mask=None):
        return self.predict(tokens, feature, positions, cache.attention(mask))

    def draft_logits(self, feature):
        return self.lm_head(self.norm(feature))
