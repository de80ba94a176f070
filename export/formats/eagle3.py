"""What the EAGLE-3 layouts of other engines (speculators/vLLM, SGLang/SpecForge/EAGLE) share: the
Llama-style config of the draft layer, their weight files, and turning one of their heads into ours."""

from __future__ import annotations

import glob
import math
import os
import pickle

import torch
from transformers import LlamaConfig, PretrainedConfig

from drafters.config.errors import UserError
from drafters.layers import draft_layer_config
from drafters.storage.artifact import SavedDrafter, default_proposal, read_weights, verifier_of
from drafters.target.model import TargetSpec
from export.formats import ImportFor

EMBEDDING = "embed_tokens.weight"


def llama_fields(saved: SavedDrafter) -> dict:
    """Our draft decoder layer (drafters/layers.py: draft_layer_config) as the Llama config fields
    engines build theirs from."""
    layer = draft_layer_config(saved.spec)
    rope = dict(layer.rope_parameters)
    return {
        "model_type": "llama",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": layer.hidden_act,
        "rms_norm_eps": layer.rms_norm_eps,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": layer.vocab_size,  # the target's: d2t/t2d map the draft vocabulary into it
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,  # SGLang would make lm_head the embedding
        # transformers 5 reads rope_parameters; the 4.x releases engines pin read rope_theta/rope_scaling
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope.get("rope_type", "default") == "default"
        else {key: value for key, value in rope.items() if key != "rope_theta"},
        "torch_dtype": str(saved.weights["fc.weight"].dtype).removeprefix("torch."),
    }


def check_layer_config(theirs: dict, spec: TargetSpec, where: str, drafter: str = "EAGLE-3") -> None:
    """Refuse a head (EAGLE-3, or EAGLE-1: `drafter`) whose one-layer draft model computes differently
    from ours on this target in ways the weight shapes don't show (layer count, layer type, and
    check_layer_math's)."""
    if theirs.get("num_hidden_layers", 1) != 1:
        raise UserError(f"{where}: {theirs['num_hidden_layers']} draft layers; our {drafter} has one")
    if theirs.get("model_type", "llama") != "llama":
        raise UserError(f"{where}: a '{theirs['model_type']}' draft layer; our {drafter} layer is Llama's")
    check_layer_math(LlamaConfig(**theirs), spec, where, drafter)


def check_layer_math(their_layer: PretrainedConfig, spec: TargetSpec, where: str, drafter: str) -> None:
    """Refuse draft layers (their config, RoPE normalized from either rope_parameters or
    rope_theta/rope_scaling) with a tied lm_head, or a RoPE, activation or norm epsilon other than the
    target's, which our `drafter`'s layers use. A head made for another target is named as such first:
    its width (and vocabulary) is what differs, whatever else does."""
    if their_layer.hidden_size != spec.hidden_size:
        raise UserError(f"{where}: a head of hidden_size={their_layer.hidden_size}, made for another target: the target "
                        f"{spec.name} has hidden_size={spec.hidden_size} (pass the target it was made for: target=...)")
    if their_layer.tie_word_embeddings:
        raise UserError(f"{where}: tie_word_embeddings=true (lm_head is the embedding); ours has its own lm_head")
    ours = draft_layer_config(spec)
    for field in ("rope_parameters", "hidden_act"):
        if getattr(their_layer, field) != getattr(ours, field):
            raise UserError(f"{where}: draft layer {field}={getattr(their_layer, field)}, the target "
                            f"{spec.name} (whose settings our {drafter} uses) has {getattr(ours, field)}")
    if not math.isclose(their_layer.rms_norm_eps, ours.rms_norm_eps, rel_tol=1e-3):
        raise UserError(f"{where}: draft layer rms_norm_eps={their_layer.rms_norm_eps}, the target {spec.name} "
                        f"has {ours.rms_norm_eps}")


def read_weight_files(path: str, torch_files: str = "*.bin") -> dict[str, torch.Tensor]:
    """Every tensor of a head dir: *.safetensors (single or sharded), else its `torch_files` (by
    default the EAGLE repo's pytorch_model.bin)."""
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        weights.update(read_weights(file, path))
    if weights:
        return weights
    for file in sorted(glob.glob(os.path.join(path, torch_files))):
        try:
            weights.update(torch.load(file, map_location="cpu", weights_only=True))
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:  # corrupt or unsafe
            reason = str(error).splitlines()[0]
            raise UserError(f"{path}: unreadable weights {os.path.basename(file)} ({reason})") from None
    if not weights:
        raise UserError(f"{path}: no weights (*.safetensors or {torch_files})")
    return weights


def imported(where: str, weights: dict, aux_layers: list[int], draft_vocab_size: int, context: ImportFor,
             name_or_path: str | None = None, steps: int | None = None, hparams: dict | None = None) -> SavedDrafter:
    """Another engine's head (EAGLE-3, DFlash) as ours: their weights under our names, the target's
    embedding where they ship none (engines share the target's), hyper-parameters as our drafter config
    gives them for these aux layers (our convention), overridden by `hparams` read from their config."""
    context.target.check_layers(aux_layers)
    cfg = {**context.drafter_cfg, **(hparams or {}), "aux_layers": aux_layers, "draft_vocab_size": draft_vocab_size}
    spec = context.target.spec.to_dict()
    saved = SavedDrafter(cfg["name"], cfg, verifier_of(spec, context.target_cfg, name_or_path), context.target_cfg,
                         dict(weights), proposal={})
    saved.hparams = saved.skeleton().hparams()  # exactly what the drafter records about itself
    saved.proposal = default_proposal(saved.drafter, saved.hparams)
    if steps:  # the chain length their format records
        saved.proposal["steps"] = int(steps)
    if EMBEDDING not in saved.weights and "fc.weight" in saved.weights:
        saved.weights[EMBEDDING] = context.target.embed_weight.detach().to(saved.weights["fc.weight"].dtype).clone()
    saved.check_weights(where)
    return saved
