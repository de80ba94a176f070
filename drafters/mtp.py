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
(b) `native_mtp: true`: the module is read from the target's safetensors in one of the LAYOUTS below,
    fine-tuned, and `export.run format=target_mtp` writes it back under the same keys, so an engine's
    native MTP path (vLLM/SGLang `deepseek_mtp`, `qwen3_next_mtp`) serves the fine-tuned weights.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
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
from drafters.target.model import TargetClasses, full_attention_rope

ATTENTION = "specdraft_mtp"


def block_attention(module, query, key, value, attention_mask, scaling=None, attend=None, **_):
    """The MTP block's attention (its config's `_attn_implementation`): the HF module computes q, k, v
    its own way (MLA, gated heads, q/k norms), `attend(q, k, v)` decides what they see: TTT attention
    in training, the DraftCache at serving."""
    width = value.shape[-1]
    # attend() scales by 1/sqrt(head size): the module's own scale (Gemma's, MLA's) goes into q
    query = query * (scaling * query.shape[-1] ** 0.5)
    # MLA's values are narrower than its keys: padded (as HF's flash path does) for the fused kernels
    value = F.pad(value, (0, query.shape[-1] - width))
    groups = module.num_key_value_groups
    out = attend(query, repeat_kv(key, groups), repeat_kv(value, groups))
    return out[..., :width].transpose(1, 2), None


AttentionInterface.register(ATTENTION, block_attention)


@dataclass(frozen=True)
class NativeLayout:
    """Where a target checkpoint keeps its MTP module and what our top-level modules are called there;
    a module it lacks (Qwen's embedding and head) is the target's own."""

    name: str
    prefix: str  # {N}: the target's layer count (DeepSeek-V3 numbers its MTP layer after the last one)
    names: dict  # our module -> theirs ("" = directly under the prefix)

    def key(self, ours: str, num_layers: int) -> str:
        module, _, rest = ours.partition(".")
        theirs = self.names[module]
        return self.prefix.format(N=num_layers) + (f"{theirs}.{rest}" if theirs else rest)

    def owns(self, ours: str) -> bool:
        return ours.partition(".")[0] in self.names

    def to_checkpoint(self, weights: dict, num_layers: int) -> dict:
        """Our weights under the checkpoint's keys; the experts HF fuses are one tensor each there."""
        out = {}
        for name, tensor in weights.items():
            if not self.owns(name):
                continue
            key = self.key(name, num_layers)
            if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: each expert's [gate ; up]
                for expert, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                    out[expert_key(key, expert, "gate_proj")], out[expert_key(key, expert, "up_proj")] = gate, up
            elif name.endswith("experts.down_proj"):
                out.update({expert_key(key, expert, "down_proj"): down for expert, down in enumerate(tensor)})
            else:
                out[key] = tensor
        return out

    def from_checkpoint(self, read, expected: dict, num_layers: int) -> dict:
        """Our weights named and shaped like `expected`, from a checkpoint's `read(key)`."""
        out = {}
        for name, like in expected.items():
            key = self.key(name, num_layers)
            if name.endswith("experts.gate_up_proj"):
                gates = torch.stack([read(expert_key(key, expert, "gate_proj")) for expert in range(len(like))])
                ups = torch.stack([read(expert_key(key, expert, "up_proj")) for expert in range(len(like))])
                out[name] = torch.cat([gates, ups], 1)
            elif name.endswith("experts.down_proj"):
                out[name] = torch.stack([read(expert_key(key, expert, "down_proj")) for expert in range(len(like))])
            else:
                out[name] = read(key)
            if out[name].shape != like.shape:
                raise UserError(f"{key}: shape {list(out[name].shape)}, this target's MTP module has {list(like.shape)}")
        return out


def expert_key(fused_key: str, expert: int, projection: str) -> str:
    return f"{fused_key.rsplit('.', 1)[0]}.{expert}.{projection}.weight"


LAYOUTS = (
    NativeLayout("deepseek_v3", "model.layers.{N}.", {
        "embed_tokens": "embed_tokens", "enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "block": "",
        "norm": "shared_head.norm", "lm_head": "shared_head.head"}),
    NativeLayout("qwen3_next", "mtp.", {  # Qwen3-Next and Qwen3.5
        "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "block": "layers.0",
        "norm": "norm"}),
)


def layout_named(name: str) -> NativeLayout:
    return next(layout for layout in LAYOUTS if layout.name == name)


def safetensors_reader(directory: str):
    """(every key of the *.safetensors files in `directory`, read(key) -> tensor), reading lazily."""
    files = {}
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(file, framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file))

    def read(key: str) -> torch.Tensor:
        if key not in files:
            raise UserError(f"{directory}: MTP weight {key} is missing")
        with safe_open(files[key], framework="pt") as handle:
            return handle.get_tensor(key)

    return files.keys(), read


@register("mtp")
class MTP(StepDrafter):
    @dataclass
    class Settings(settings.Drafter):
        ttt_steps: int = at_least(1)
        loss_decay: float = above(0)
        native_mtp: bool = anything()
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
        self.register_buffer("d2t", vocab.d2t.clone(), persistent=True)
        self.register_buffer("t2d", vocab.t2d.clone(), persistent=True)

    def capture_layers(self):
        return [self.spec.num_layers]  # the last layer's output, normed by `target_norm`

    def hparams(self):
        return {
            "ttt_steps": int(self.cfg.ttt_steps),
            "loss_decay": float(self.cfg.loss_decay),
            "draft_vocab_size": self.vocab.draft_size,
            "native_layout": self.native_layout,
        }

    @classmethod
    def default_steps(cls, hparams):
        return int(hparams["ttt_steps"])  # the unroll it was trained for

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
                                head=lambda hidden: self.lm_head(self.norm(hidden)))

    # ---- serving: the same block, run incrementally over a DraftCache (see StepDrafter)

    def step(self, cache: DraftCache, tokens, feature, positions, mask=None):
        feature = self.predict(tokens, feature, positions, lambda q, k, v: cache.attend(q, k, v, mask))
        return feature, self.lm_head(self.norm(feature))
