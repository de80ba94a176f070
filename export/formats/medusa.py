"""Medusa heads for vLLM: `vllm serve <target> --speculative-config '{"method": "medusa", "model": "<dir>",
"num_speculative_tokens": K}'`.

vLLM's `MedusaModel` (model_executor/models/medusa.py, configs/medusa.py) has our layout and names:
`blocks.{k}.layers.{j}` residual blocks (`medusa_fc_bias: true` for their biases) and
`lm_heads.{k}`, fed the target's final normed hidden state. A draft vocabulary is its
`truncated_vocab_size` + `token_map` (the target id of each draft token). vLLM drafts a chain of
each head's top token; SGLang has no Medusa.
"""

from __future__ import annotations

from drafters.artifact import SavedDrafter, write_files
from export.formats import Format, register


def write_vllm(saved: SavedDrafter, directory: str) -> None:
    hparams, verifier = saved.hparams, saved.verifier
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": verifier["hidden_size"],
        "vocab_size": verifier["vocab_size"],
        "num_heads": hparams["num_heads"],
        "num_hidden_layers": hparams["num_layers"],
        "medusa_fc_bias": True,
        "truncated_vocab_size": hparams["draft_vocab_size"],
        "torch_dtype": str(saved.weights["lm_heads.0.weight"].dtype).removeprefix("torch."),
    }
    # the copy of the target's final norm stays behind: vLLM hands the heads the normed state
    weights = {name: tensor for name, tensor in saved.weights.items() if name.startswith(("blocks.", "lm_heads."))}
    if hparams["draft_vocab_size"] < verifier["vocab_size"]:
        weights["token_map"] = saved.vocab().draft_ids
    write_files(directory, config, weights)


register(Format("vllm", "medusa", write=write_vllm))
