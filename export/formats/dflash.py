"""speculators format, DFlash and DSpark (what `vllm serve <dir>` loads): write ours, read theirs.

Config as speculators 0.9.0 writes it (DFlashSpeculatorConfig / DSparkSpeculatorConfig): a Qwen3
`transformer_layer_config` with our layer count, `block_size`, `mask_token_id`, and
`sample_from_anchor: false`: our block is [last committed token, mask x (block_size-1)] and slot
j >= 1 drafts token p+j, so block_size-1 speculative tokens. DSpark adds the Markov head's rank
and the two head flags that describe ours (vanilla Markov bias, confidence head over
[hidden ; Markov embedding]).

Weights keep our names, which are speculators' (`layers.{i}.*`, `fc`, `hidden_norm`, `norm`,
`lm_head`, `d2t`, `t2d`, `markov_head.*`, `confidence_head.proj`); no embedding is written
(speculators and vLLM take the target's).

Aux layer ids: `aux_hidden_state_layer_ids` is ours as is (input of layer k). vLLM's config
translation (`update_dflash`) derives `dflash_config.target_layer_ids` from it minus 1, z-lab's
native convention (output of layer k, read as hidden_states[k + 1]); it is written too, so readers
of z-lab's layout capture the same states, and read back (plus 1) when a config has only it.
"""

from __future__ import annotations

from transformers import Qwen3Config

from drafters.config.errors import UserError
from drafters.storage.artifact import SavedDrafter, write_files
from export.formats import Format, ImportFor, register
from export.formats.eagle3 import (
    EMBEDDING,
    check_layer_math,
    imported,
    llama_fields,
    read_weight_files,
)
from export.formats.speculators import proposal_of, speculators_config
from export.layer_ids import translate_layer_ids

ARCHITECTURES = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}
DSPARK_HEADS = {"markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}


def qwen3_fields(saved: SavedDrafter) -> dict:
    """Our draft layers as the Qwen3 config speculators builds `Qwen3DFlashDecoderLayer`s from."""
    fields = {**llama_fields(saved), "model_type": "qwen3", "num_hidden_layers": saved.hparams["num_layers"]}
    del fields["mlp_bias"]  # no Qwen3 field
    return fields


def write(saved: SavedDrafter, directory: str) -> None:
    hparams = saved.hparams
    config = {
        "architectures": [ARCHITECTURES[saved.drafter]],
        "speculators_model_type": saved.drafter,
        "transformer_layer_config": qwen3_fields(saved),
        "draft_vocab_size": hparams["draft_vocab_size"],
        "block_size": hparams["block_size"],
        "target_hidden_size": saved.verifier["hidden_size"],
        "aux_hidden_state_layer_ids": hparams["aux_layers"],
        "mask_token_id": hparams["mask_token_id"],
        "sample_from_anchor": False,
        # our blocks attend both ways; speculators does so in full-attention layers whatever this says,
        # vLLM 0.32 only where it is true (dflash_config.causal = not it, for every layer)
        "sliding_window_non_causal": True,
        **({"markov_rank": hparams["markov_rank"], **DSPARK_HEADS} if saved.drafter == "dspark" else {}),
        "dflash_config": {"mask_token_id": hparams["mask_token_id"],
                          "target_layer_ids": translate_layer_ids(hparams["aux_layers"], "input", "output")},
        "speculators_config": speculators_config(saved, saved.drafter, hparams["block_size"] - 1),
    }
    write_files(directory, config, {name: tensor for name, tensor in saved.weights.items() if name != EMBEDDING})


def layer_config(config: dict, where: str) -> Qwen3Config:
    """Their draft layers' config, read as speculators reads it (Qwen3's defaults for what is missing)."""
    theirs = dict(config.get("transformer_layer_config") or {})
    if theirs.get("model_type", "qwen3") != "qwen3":
        raise UserError(f"{where}: a '{theirs['model_type']}' draft layer; our DFlash layer is Qwen3's")
    layer = Qwen3Config(**theirs)
    if "sliding_attention" in (layer.layer_types or []):
        raise UserError(f"{where}: sliding-window draft layers (layer_types={layer.layer_types}); "
                        "our DFlash layers attend to the whole context")
    return layer


def read(path: str, config: dict, context: ImportFor) -> SavedDrafter:
    drafter = config["speculators_model_type"]
    if context.drafter_cfg.get("name") != drafter:
        raise UserError(f"{path}: a speculators {drafter} head; import it with drafter={drafter} "
                        f"(not {context.drafter_cfg.get('name')})")
    # speculators' default when the key is missing: DSpark samples from the anchor, DFlash does not
    if config.get("sample_from_anchor", drafter == "dspark"):
        raise UserError(f"{path}: sample_from_anchor=true (the anchor slot drafts too); our {drafter} drafts "
                        "from the mask slots only (sample_from_anchor=false)")
    layer = layer_config(config, path)
    check_layer_math(layer, context.target.spec, path, drafter)
    native = config.get("dflash_config") or {}
    aux_layers = config.get("aux_hidden_state_layer_ids") or (
        native.get("target_layer_ids") and translate_layer_ids(native["target_layer_ids"], "output", "input"))
    mask_token_id = config.get("mask_token_id")
    if mask_token_id is None:  # speculators writes null when unset
        mask_token_id = native.get("mask_token_id")
    if not aux_layers or mask_token_id is None:
        raise UserError(f"{path}: no {'aux_hidden_state_layer_ids' if not aux_layers else 'mask_token_id'} "
                        "(nor dflash_config's): the head cannot be run without it")
    hparams = {"block_size": config.get("block_size", 8), "num_layers": layer.num_hidden_layers,
               "mask_token_id": mask_token_id}
    if drafter == "dspark":
        unlike = [f"{key}={config[key]}" for key, ours in DSPARK_HEADS.items() if config.get(key, ours) != ours]
        if unlike:
            raise UserError(f"{path}: {', '.join(unlike)}: our DSpark has a vanilla Markov head and a confidence "
                            "head over [hidden ; Markov embedding], so this head cannot be imported faithfully")
        hparams["markov_rank"] = config.get("markov_rank", 256)  # speculators' default
    return imported(path, read_weight_files(path), list(aux_layers), config.get("draft_vocab_size", 32000),
                    context, hparams=hparams, **proposal_of(config))


for _drafter in ARCHITECTURES:  # one reader each: export.run gives a reader its own drafter's config
    register(Format("speculators", _drafter, write=write, read=read,
                    recognizes=lambda config, drafter=_drafter: config.get("speculators_model_type") == drafter))
