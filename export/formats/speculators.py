"""speculators format, EAGLE-3 (what `vllm serve <dir>` loads): write ours, read theirs.

Norm flags, against speculators' Eagle3DraftModel (models/eagle3/core.py, model_definitions.py):
our layer (drafters/eagle3.py) norms the token embedding and the fused feature before attention
but keeps the *raw* feature as the residual (norm_before_residual=False), applies no norm over the
concatenated aux states before `fc` (norm_before_fc=False), one per state only with
`drafter.fc_norm` (fc_norm, weights `fc_norm.{i}.weight` as theirs), and feeds the layer's
pre-norm output back between draft steps (norm_output=False). vLLM assumes
norm_before_residual=True when the key is missing, so all four are always written.
"""

from __future__ import annotations

from drafters.config.errors import UserError
from drafters.eagle3 import default_aux_layers
from drafters.storage.artifact import SavedDrafter, write_files
from export.formats import Format, ImportFor, register
from export.formats.eagle3 import check_layer_config, imported, llama_fields, read_weight_files

NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "norm_output": False}  # and fc_norm: ours
OURS, THEIRS = "midlayer.", "layers.0."  # the draft decoder layer's weight prefix


def renamed(weights: dict, old: str, new: str) -> dict:
    return {(new + name[len(old):] if name.startswith(old) else name): tensor for name, tensor in weights.items()}


def speculators_config(saved: SavedDrafter, algorithm: str, steps: int) -> dict:
    """The `speculators_config` block: a greedy proposal of `steps` tokens and the verifier vLLM loads."""
    verifier = saved.verifier
    if not verifier.get("name_or_path"):
        raise UserError(f"format=speculators: vLLM loads the target from verifier.name_or_path, and target "
                        f"{verifier['name']} has no HF dir or hub id recorded (a GGUF file or a random init): "
                        "pass verifier=<hub id or HF dir>, or verifier_out=<dir> to write the target there "
                        "as HF safetensors")
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": verifier["name_or_path"], "architectures": [verifier["architecture"]]},
    }


def proposal_of(config: dict) -> dict:
    """What a speculators config says about serving: imported()'s name_or_path and steps."""
    speculators = config.get("speculators_config") or {}
    proposals = speculators.get("proposal_methods") or [{}]
    return {"name_or_path": (speculators.get("verifier") or {}).get("name_or_path"),
            "steps": proposals[0].get("speculative_tokens")}


def write(saved: SavedDrafter, directory: str) -> None:
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": saved.hparams["draft_vocab_size"],
        "eagle_aux_hidden_state_layer_ids": saved.hparams["aux_layers"],  # same convention as ours
        **NORM_FLAGS,
        "fc_norm": bool(saved.hparams.get("fc_norm")),
        "target_hidden_size": saved.verifier["hidden_size"],
        "transformer_layer_config": llama_fields(saved),
        "speculators_config": speculators_config(saved, "eagle3", saved.proposal["steps"]),
    }
    write_files(directory, config, renamed(saved.weights, OURS, THEIRS))


def recognizes(config: dict) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def read(path: str, config: dict, context: ImportFor) -> SavedDrafter:
    # speculators' own default for a missing flag is False
    unlike_ours = [flag for flag, ours in NORM_FLAGS.items() if bool(config.get(flag, False)) != ours]
    if unlike_ours:
        raise UserError(f"{path}: {', '.join(f'{flag}=true' for flag in unlike_ours)}: our EAGLE-3 computes no such "
                        "norm, so this head cannot be imported faithfully")
    check_layer_config(config.get("transformer_layer_config") or {}, context.target.spec, path)
    aux_layers = config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(context.target.spec.num_layers)
    return imported(path, renamed(read_weight_files(path), THEIRS, OURS), list(aux_layers),
                    config.get("draft_vocab_size", 32000),  # speculators' default
                    context, **proposal_of(config), hparams={"fc_norm": bool(config.get("fc_norm", False))})


register(Format("speculators", "eagle3", write=write, recognizes=recognizes, read=read))
