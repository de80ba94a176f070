"""target_mtp: a fine-tuned native MTP module (drafter=mtp, native_mtp=true) written back under its
target checkpoint's own keys (DeepSeek-V3 `model.layers.{N}.*`, Qwen3-Next / Qwen3.5 `mtp.*`, MoE
experts one tensor each as checkpoints keep them), so an engine's native MTP path serves it once the
tensors replace the target's (docs/drafters.md: "MTP"); and read back, to serve or fine-tune it again here.

The directory holds `model.safetensors` (those tensors, nothing else) and a small `config.json`
naming the layout and the target.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from drafters.base import build_drafter
from drafters.config.errors import UserError
from drafters.storage.artifact import SavedDrafter, default_proposal, verifier_of, write_files
from drafters.storage.mtp_layouts import layout_named
from drafters.target.vocab import build_draft_vocab
from export.formats import Format, ImportFor, register

FORMAT = "specdraft.target_mtp"


def write(saved: SavedDrafter, directory: str) -> None:
    if not saved.hparams.get("native_layout"):
        raise UserError("format=target_mtp writes an MTP module back into its target checkpoint's layout; this one "
                        "was trained from scratch (drafter.native_mtp=false), so there is no layout to write: "
                        "use format=native")
    layout, layers = layout_named(saved.hparams["native_layout"]), saved.verifier["num_layers"]
    config = {
        "format": FORMAT,
        "layout": layout.name,
        "keys": layout.prefix.format(N=layers) + "*",
        "target": saved.verifier["name_or_path"] or saved.verifier["name"],
        "hparams": saved.hparams,
    }
    write_files(directory, config, layout.to_checkpoint(saved.weights, layers))


def recognizes(config: dict) -> bool:
    return config.get("format") == FORMAT


def read(path: str, config: dict, context: ImportFor) -> SavedDrafter:
    """The module over an MTP drafter built on the target (whose embedding, head and final norm fill
    what the layout does not hold), drafting over the full vocabulary like the native module."""
    target = context.target
    vocab_size = target.spec.vocab_size
    identity = build_draft_vocab([], vocab_size, vocab_size, {"target_mtp": path})
    cfg = {**context.drafter_cfg, **config.get("hparams", {}), "name": "mtp", "native_mtp": False,
           "draft_vocab_size": vocab_size}
    drafter = build_drafter(OmegaConf.create(cfg), target, identity)
    drafter.native_layout = drafter.load_native(path, f"target_mtp artifact {path}").name
    hparams = drafter.hparams()
    return SavedDrafter("mtp", hparams, verifier_of(target.spec.to_dict(), context.target_cfg), context.target_cfg,
                        {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()},
                        default_proposal("mtp", hparams))


register(Format("target_mtp", "mtp", write=write, recognizes=recognizes, read=read))
