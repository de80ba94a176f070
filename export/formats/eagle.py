"""EAGLE-1 heads for vLLM and SGLang: the EAGLE repo's layout, a one-layer Llama config with `fc.*`
and `layers.0.*` (our `midlayer.*`), no embedding and no lm_head (both engines give the head the
target's), fed the target's final normed hidden state, as ours is.

- format=vllm: `vllm serve <target> --speculative-config '{"method": "eagle", "model": "<dir>"}'`.
  vLLM builds `EagleLlamaForCausalLM` (model_executor/models/llama_eagle.py): `fc` without bias,
  layer 0 without input norm, the layer's output read by the target's lm_head over the whole
  vocabulary. It has no draft-vocabulary map, so only a full-vocabulary head is written.
- format=sglang: `--speculative-algorithm EAGLE --speculative-draft-model-path <dir>`
  (`LlamaForCausalLMEagle`, srt/models/llama_eagle.py): the same, but its `fc` has a bias (written
  as zeros). A draft vocabulary is SGLang's FR-Spec hot-token list: `token_map.pt` (the target ids
  of the draft tokens), passed as `--speculative-token-map <dir>/token_map.pt`.
"""

from __future__ import annotations

import os

import torch

from drafters.artifact import SavedDrafter, write_files
from drafters.errors import UserError
from export.formats import Format, register
from export.formats.eagle3 import llama_fields
from export.formats.speculators import renamed

TOKEN_MAP = "token_map.pt"


def head_weights(saved: SavedDrafter) -> dict[str, torch.Tensor]:
    """fc + the decoder layer under the EAGLE repo's names; the target's embedding, lm_head and
    final norm (copies in ours) stay with the target."""
    layer = {name: tensor for name, tensor in saved.weights.items() if name.startswith(("fc.", "midlayer."))}
    return renamed(layer, "midlayer.", "layers.0.")


def full_vocabulary(saved: SavedDrafter) -> bool:
    return saved.hparams["draft_vocab_size"] == saved.verifier["vocab_size"]


def write_vllm(saved: SavedDrafter, directory: str) -> None:
    if not full_vocabulary(saved):
        raise UserError(f"format=vllm: vLLM's EAGLE-1 drafts over the target's whole vocabulary "
                        f"({saved.verifier['vocab_size']} tokens), this head over {saved.hparams['draft_vocab_size']}: "
                        f"train it with drafter.draft_vocab_size={saved.verifier['vocab_size']}, or use format=sglang")
    write_files(directory, {"architectures": ["LlamaForCausalLM"], **llama_fields(saved)}, head_weights(saved))


def write_sglang(saved: SavedDrafter, directory: str) -> None:
    weights = head_weights(saved)
    weights["fc.bias"] = torch.zeros(saved.verifier["hidden_size"], dtype=weights["fc.weight"].dtype)
    write_files(directory, {"architectures": ["LlamaForCausalLMEagle"], **llama_fields(saved)}, weights)
    if not full_vocabulary(saved):
        torch.save(saved.vocab().draft_ids, os.path.join(directory, TOKEN_MAP))


register(Format("vllm", "eagle", write=write_vllm))
register(Format("sglang", "eagle", write=write_sglang))
