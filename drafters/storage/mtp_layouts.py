"""Where target checkpoints keep a native MTP module (DeepSeek-V3, Qwen3-Next), and how drafter=mtp's
weights map to and from those keys: read by `MTP.load_native`, written by `export.run format=target_mtp`."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from drafters.config.errors import UserError


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
