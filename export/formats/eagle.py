"""EAGLE-1 heads for vLLM and SGLang: the EAGLE repo's layout, a one-layer Llama config with `fc.*`
and `layers.0.*` (our `midlayer.*`), no embedding and no lm_head (both engines give the head the
target's), fed the target's final normed hidden state, as ours is.

- format=vllm: `vllm serve <target> --speculative-config '{"method": "eagle", "model": "<dir>"}'`.
  vLLM builds `EagleLlamaForCausalLM` (model_executor/models/llama_eagle.py): `fc` without bias,
  layer 0 without input norm, the layer's output read by the target's lm_head over the whole
  vocabulary. It has no draft-vocabulary map, so only a full-vocabulary head is written.
- format=sglang: `--speculative-algorithm EAGLE --speculative-draft-model-path <dir>`
  (`LlamaForCausalLMEagle`, srt/models/llama_eagle.py): the same, but its `fc` has a bias (zeros
  unless the head has one: `drafter.fc_bias`). A draft vocabulary is SGLang's FR-Spec hot-token
  list: `token_map.pt` (the target ids of the draft tokens), passed as
  `--speculative-token-map <dir>/token_map.pt`.

Both read back, and so do the EAGLE repo's own EAGLE-1 heads (eagle/model/cnets1.py: the vLLM
layout's config, `pytorch_model.bin` with `fc.bias` and the `embed_tokens.weight` it was trained
with): their `fc`, layer and embedding over a drafter built on the target (lm_head rows, final norm).
"""

from __future__ import annotations

import os
import pickle

import torch

from drafters.config.errors import UserError
from drafters.storage.artifact import SavedDrafter, write_files
from drafters.storage.engines import check_vllm_vocabulary
from export.formats import Format, ImportFor, built_on_target, check_sizes, draft_vocabulary, register
from export.formats.eagle3 import check_layer_config, llama_fields, read_weight_files
from export.formats.speculators import OURS, THEIRS, renamed

TOKEN_MAP = "token_map.pt"
SGLANG = "LlamaForCausalLMEagle"
EAGLE3_KEYS = ("draft_vocab_size", "eagle_config", "speculators_model_type")  # EAGLE-3 configs have them, EAGLE-1's not


def head_weights(saved: SavedDrafter) -> dict[str, torch.Tensor]:
    """fc + the decoder layer under the EAGLE repo's names; the target's embedding, lm_head and
    final norm (copies in ours) stay with the target."""
    layer = {name: tensor for name, tensor in saved.weights.items() if name.startswith(("fc.", "midlayer."))}
    return renamed(layer, OURS, THEIRS)


def full_vocabulary(saved: SavedDrafter) -> bool:
    return saved.hparams["draft_vocab_size"] == saved.verifier["vocab_size"]


def write_vllm(saved: SavedDrafter, directory: str) -> None:
    check_vllm_vocabulary("format=vllm", "eagle", saved.hparams["draft_vocab_size"], saved.verifier["vocab_size"],
                          ", or use format=sglang")
    if "fc.bias" in saved.weights:
        raise UserError("format=vllm: vLLM's EAGLE-1 fc has no bias and this head's has one "
                        "(drafter.fc_bias, as the EAGLE repo and SGLang have it): use format=sglang")
    write_files(directory, {"architectures": ["LlamaForCausalLM"], **llama_fields(saved)}, head_weights(saved))


def write_sglang(saved: SavedDrafter, directory: str) -> None:
    weights = head_weights(saved)
    weights.setdefault("fc.bias", torch.zeros(saved.verifier["hidden_size"], dtype=weights["fc.weight"].dtype))
    write_files(directory, {"architectures": [SGLANG], **llama_fields(saved)}, weights)
    if not full_vocabulary(saved):
        torch.save(saved.vocab().draft_ids, os.path.join(directory, TOKEN_MAP))


def eagle1_config(config: dict, architectures: set[str]) -> bool:
    named = bool(architectures & set(config.get("architectures") or []))
    return named and not any(key in config for key in EAGLE3_KEYS)


def recognizes_vllm(config: dict) -> bool:
    """vLLM's layout and the EAGLE repo's: a one-layer Llama (vLLM makes it EagleLlamaForCausalLM)."""
    return config.get("num_hidden_layers") == 1 and eagle1_config(config, {"LlamaForCausalLM", "EagleLlamaForCausalLM"})


def recognizes_sglang(config: dict) -> bool:
    return eagle1_config(config, {SGLANG})  # an exact name: not SGLang's EAGLE-3, LlamaForCausalLMEagle3


def read_token_map(path: str) -> torch.Tensor | None:
    """SGLang's FR-Spec hot tokens beside the head (the target ids of the draft tokens), if any."""
    file = os.path.join(path, TOKEN_MAP)
    if not os.path.isfile(file):
        return None
    try:
        return torch.as_tensor(torch.load(file, map_location="cpu", weights_only=True))
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
        raise UserError(f"{path}: unreadable {TOKEN_MAP} ({str(error).splitlines()[0]})") from None


def read(path: str, config: dict, context: ImportFor) -> SavedDrafter:
    spec = context.target.spec
    check_sizes(config, spec, path)
    check_layer_config(config, spec, path, "EAGLE-1")
    theirs = renamed(read_weight_files(path), THEIRS, OURS)
    if "fc.bias" in theirs and not theirs["fc.bias"].any():
        del theirs["fc.bias"]  # a zero bias (ours, as SGLang gets it) is none
    vocab, _ = draft_vocabulary(read_token_map(path), spec.vocab_size, path)  # lm_head rows are the target's
    return built_on_target(path, "eagle", {"fc_bias": "fc.bias" in theirs}, vocab, theirs, context)


register(Format("vllm", "eagle", write=write_vllm, recognizes=recognizes_vllm, read=read))
register(Format("sglang", "eagle", write=write_sglang, recognizes=recognizes_sglang, read=read))
