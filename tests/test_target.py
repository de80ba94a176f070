"""Loading the target: a GGUF file is converted once into an HF dir that loads what the GGUF holds."""

import os

import pytest
import torch

from conftest import compose_train
from drafters.target.model import cache_root, converted_gguf, load_target, resolve_path


@pytest.mark.slow
def test_converted_gguf_holds_the_ggufs_weights_and_tokenizer():
    """The session's own conversion (the SmolLM2 tests share it: a conversion costs ~20 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = compose_train(["target=llama", "target.dtype=float32"]).target
    target = load_target(cfg)
    converted = converted_gguf(resolve_path(cfg), cfg.gguf_file)
    assert converted.startswith(cache_root()) and os.path.isfile(os.path.join(converted, "model.safetensors"))
    original = AutoModelForCausalLM.from_pretrained(resolve_path(cfg), gguf_file=cfg.gguf_file, dtype=torch.float32)
    ours, theirs = target.model.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(cfg), gguf_file=cfg.gguf_file)
    text = "<|im_start|>user\nHow many r's in strawberry? 123<|im_end|>"
    assert target.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert target.tokenizer.chat_template == tokenizer.chat_template
