"""Loading the target: a GGUF file is converted once into an HF dir that loads what the GGUF holds."""

import os

import pytest
import torch

from conftest import compose_train
from drafters.target.model import (FEW_ROWS, FewRowsLinear, cache_root, converted_gguf, fast_rows, load_target, project,
                                   resolve_path)


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


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 15, 27, FEW_ROWS, FEW_ROWS + 1])
def test_a_few_rows_are_multiplied_weight_first_to_the_same_product(rows):
    torch.manual_seed(0)
    weight, x = torch.randn(300, 64), torch.randn(1, rows, 64)
    assert project(x, weight).shape == (1, rows, 300)
    torch.testing.assert_close(project(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    linear = torch.nn.Linear(64, 300)
    expected = linear(x)
    linear.__class__ = FewRowsLinear
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(project(x.bfloat16(), weight.bfloat16()), x.bfloat16() @ weight.bfloat16().T)  # other dtypes as before


def test_few_rows_are_padded_up_to_the_next_fast_count_and_never_past_the_bound():
    padded = [fast_rows(rows) for rows in range(1, FEW_ROWS + 1)]
    assert padded[:16] == [2, 2, 4, 4, 5, 6, 8, 8, 9, 16, 16, 16, 16, 16, 16, 16]
    assert all(rows <= fast <= FEW_ROWS and fast - rows < 8 for rows, fast in enumerate(padded, 1))


def test_the_targets_linear_layers_take_the_few_rows_path(tiny_target):
    linears = [module for module in tiny_target.model.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(type(module) is FewRowsLinear for module in linears)
