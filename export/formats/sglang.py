"""SGLang's EAGLE-3 format (`LlamaForCausalLMEagle3`; also what SpecForge and the EAGLE repo write):
write ours, read theirs.

Aux layer ids: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as "output of layer k"
and captures before layer k+1 (`set_eagle3_layers_to_capture`: `val + 1`), so ours are written
minus 1. A config without them makes SGLang (and the EAGLE repo) capture [2, N//2, N-3] in our
convention. No embedding is written: SGLang gives the draft model the target's.
"""

from __future__ import annotations

from drafters.config.errors import UserError
from drafters.eagle3 import default_aux_layers
from drafters.storage.artifact import SavedDrafter, write_files
from export.formats import Format, ImportFor, register
from export.formats.eagle3 import EMBEDDING, check_layer_config, imported, llama_fields, read_weight_files
from export.layer_ids import translate_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"


def write(saved: SavedDrafter, directory: str) -> None:
    if saved.hparams.get("fc_norm"):
        raise UserError("format=sglang: SGLang's EAGLE-3 has no norm on the target states before fc "
                        "(drafter.fc_norm): use format=speculators or native")
    config = {
        "architectures": [ARCHITECTURE],
        **llama_fields(saved),
        "draft_vocab_size": saved.hparams["draft_vocab_size"],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": translate_layer_ids(saved.hparams["aux_layers"], "input", "output"),
            "use_aux_hidden_state": True,
        },
    }
    write_files(directory, config, {name: tensor for name, tensor in saved.weights.items() if name != EMBEDDING})


def recognizes(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def read(path: str, config: dict, context: ImportFor) -> SavedDrafter:
    check_layer_config(config, context.target.spec, path)
    theirs = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    num_layers = context.target.spec.num_layers
    aux_layers = translate_layer_ids(theirs, "output", "input") if theirs else default_aux_layers(num_layers)
    # no draft_vocab_size: SGLang drafts over the full vocabulary (LlamaConfig's default size if unset)
    draft_vocab_size = config.get("draft_vocab_size") or config.get("vocab_size", 32000)
    return imported(path, read_weight_files(path), aux_layers, draft_vocab_size, context)


register(Format("sglang", "eagle3", write=write, recognizes=recognizes, read=read))
