"""Medusa heads for vLLM: `vllm serve <target> --speculative-config '{"method": "medusa", "model": "<dir>",
"num_speculative_tokens": K}'`.

vLLM's `MedusaModel` (model_executor/models/medusa.py, configs/medusa.py) has our layout and names:
`blocks.{k}.layers.{j}` residual blocks (`medusa_fc_bias: true` for their biases) and
`lm_heads.{k}`, fed the target's final normed hidden state. Its layout of a draft vocabulary
(`truncated_vocab_size` + `token_map`, the target id of each draft token) reads back, but vLLM 0.32
builds every lm_head over the whole vocabulary and its loader fails an assertion on one: so only a
head over the whole vocabulary is written. vLLM drafts a chain of each head's top token; SGLang has
no Medusa.

Both vLLM's layout and the Medusa repo's (medusa/model/medusa_model.py: config `medusa_num_heads`,
`medusa_num_layers`; `medusa_lm_head.safetensors` or `.pt` holding `medusa_head`, per head a
Sequential of ResBlocks `{k}.{j}.linear.*` and the lm_head `{k}.{num_layers}.weight`) read back.
"""

from __future__ import annotations

import re

import torch

from drafters.storage.artifact import SavedDrafter, write_files
from drafters.storage.engines import check_vllm_vocabulary
from export.formats import Format, ImportFor, built_on_target, check_sizes, draft_vocabulary, register
from export.formats.eagle3 import read_weight_files


def write_vllm(saved: SavedDrafter, directory: str) -> None:
    hparams, verifier = saved.hparams, saved.verifier
    check_vllm_vocabulary("format=vllm", "medusa", hparams["draft_vocab_size"], verifier["vocab_size"])
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": verifier["hidden_size"],
        "vocab_size": verifier["vocab_size"],
        "num_heads": hparams["num_heads"],
        "num_hidden_layers": hparams["num_layers"],
        "medusa_fc_bias": True,
        "truncated_vocab_size": verifier["vocab_size"],
        "torch_dtype": str(saved.weights["lm_heads.0.weight"].dtype).removeprefix("torch."),
    }
    # the copy of the target's final norm stays behind: vLLM hands the heads the normed state
    weights = {name: tensor for name, tensor in saved.weights.items() if name.startswith(("blocks.", "lm_heads."))}
    write_files(directory, config, weights)


def recognizes(config: dict) -> bool:
    return (config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or [])
            or "medusa_num_heads" in config)


def from_medusa_repo(name: str, layers: int) -> str:
    """A Medusa repo name as ours: `{k}.{j}.linear.*` is block j of head k, `{k}.{layers}.*` its lm_head."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(linear\.)?(\w+)", name)
    if not match:
        return name  # check_weights names it
    head, index, linear, kind = match.groups()
    if linear:
        return f"blocks.{head}.layers.{index}.{kind}"
    return f"lm_heads.{head}.{kind}" if int(index) == layers else name


def read(path: str, config: dict, context: ImportFor) -> SavedDrafter:
    spec = context.target.spec
    check_sizes(config, spec, path)
    weights = read_weight_files(path, "*.pt")
    if "medusa_num_heads" in config:  # the Medusa repo's
        heads, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
        weights = {from_medusa_repo(name, layers): tensor for name, tensor in weights.items()}
    else:  # vLLM's, with its defaults (configs/medusa.py) and loader's renaming (models/medusa.py)
        heads, layers = int(config.get("num_heads", 5)), int(config.get("num_hidden_layers", 1))
        weights = {name.removeprefix("medusa_heads."): tensor for name, tensor in weights.items()}
        if config.get("original_lm_head") and "lm_heads.0.weight" in weights:  # one lm_head for every head
            weights.update({f"lm_heads.{k}.weight": weights["lm_heads.0.weight"] for k in range(heads)})
    for block in [f"blocks.{k}.layers.{j}." for k in range(heads) for j in range(layers)]:
        if block + "weight" in weights:  # no bias (vLLM's medusa_fc_bias=false): a zero one
            weight = weights[block + "weight"]
            weights.setdefault(block + "bias", torch.zeros(weight.shape[:1], dtype=weight.dtype))
    vocab, order = draft_vocabulary(weights.pop("token_map", None), spec.vocab_size, path)
    for name in [name for name in weights if name.startswith("lm_heads.")]:
        rows = weights[name]
        if len(rows) == len(order):  # over the draft tokens, in the token map's order
            weights[name] = rows[order]
        elif len(rows) == spec.vocab_size:  # over the whole vocabulary: vLLM takes the token map's rows
            weights[name] = rows[vocab.draft_ids]
    return built_on_target(path, "medusa", {"num_heads": heads, "num_layers": layers}, vocab, weights, context)


register(Format("vllm", "medusa", write=write_vllm, recognizes=recognizes, read=read))
