"""EAGLE-1 (drafters/eagle.py): layout and frozen parts, the loss against a reference written from
the serving path, training on one answer until serving accepts it, lossless greedy serving,
artifacts for native / vLLM / SGLang, and losslessness on the real SmolLM2. tests/test_medusa.py
builds on the helpers here."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import (VARIED_TARGET, assert_drafts_alike, assert_lossless_on_smollm2, assert_read_back, chat_ids,
                      compose_train, conversation, edited_head, imported, native_round_trip, plain_replies,
                      run_export, saved, train_steps, vocab_over, write_format)
from drafters.base import build_drafter, capture
from drafters.config.errors import UserError
from drafters.layers import DraftCache
from drafters.storage.artifact import read
from export import formats
from export.formats.eagle3 import llama_fields
from export.formats.speculators import renamed
from serving.engine import generate_spec


def train_cfg(*overrides):
    return compose_train([*VARIED_TARGET, "drafter=eagle", *overrides])


@pytest.fixture(scope="module")
def target(varied_target):
    return varied_target


@pytest.fixture(scope="module")
def answer(varied_target):
    return conversation(varied_target)


def make_drafter(target, vocab, *overrides, seed=0):
    torch.manual_seed(seed)
    return build_drafter(train_cfg(*overrides).drafter, target, vocab)


def test_layout_frozen_target_parts_and_feature(target, answer):
    _, reply, batch = answer
    vocab = vocab_over(target, reply)
    drafter = make_drafter(target, vocab)
    width = target.spec.hidden_size
    assert drafter.capture_layers() == [target.spec.num_layers]  # the last layer's output
    assert drafter.fc.weight.shape == (width, 2 * width) and drafter.fc.bias is None
    assert drafter.midlayer.self_attn.q_proj.weight.shape[1] == width
    assert not hasattr(drafter.midlayer, "input_layernorm")  # EAGLE's first layer has none
    assert torch.equal(drafter.lm_head.weight, target.lm_head_weight[vocab.draft_ids].float())
    trainable = {name for name, p in drafter.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith(("fc.", "midlayer.")) for name in trainable)
    # fuse = the target's final norm on the last layer's output: the target's own final hidden state
    aux, final = target.capture(batch["input_ids"], None, drafter.capture_layers())
    torch.testing.assert_close(drafter.fuse(aux), final)


def test_loss_matches_a_reference_built_on_the_serving_path(target, answer):
    """Position t reads f_t and token t+1 and predicts f_{t+1}; lm_head on it meets the teacher at
    t+1. The reference gets its predictions from `step` over a DraftCache (what serving runs) and
    sums the two terms row by row."""
    _, reply, batch = answer
    vocab = vocab_over(target, reply)
    drafter = make_drafter(target, vocab).eval()
    generator = torch.Generator().manual_seed(0)
    batch = {**batch, "loss_mask": torch.randint(0, 2, batch["loss_mask"].shape, generator=generator)}
    captured = capture(target, vocab, batch, drafter.capture_layers())
    loss, metrics = drafter.loss(batch, captured)
    assert sorted(metrics) == ["acc/1", "loss/feature", "loss/token"]

    ids = batch["input_ids"]
    feature = drafter.fuse(captured.aux)
    with torch.no_grad():
        predicted = drafter.step(DraftCache(), F.pad(ids[:, 1:], (0, 1)), feature, drafter.positions(0, ids))
        logits = drafter.draft_logits(predicted)
    feature_terms, token_terms = [], []
    for t in range(ids.shape[1] - 2):
        if batch["loss_mask"][0, t + 2] and captured.in_vocab[0, t + 1]:
            feature_terms.append(F.smooth_l1_loss(predicted[0, t], feature[0, t + 1]))
            teacher = torch.softmax(captured.teacher_logits[0, t + 1].float(), -1)
            token_terms.append(-(teacher * torch.log_softmax(logits[0, t], -1)).sum())
    assert feature_terms
    expected = torch.stack(feature_terms).mean() + 0.1 * torch.stack(token_terms).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-4, atol=1e-5)

    # training adds noise to the input features: same batch, another loss
    assert drafter.train().loss(batch, captured)[0].item() != loss.item()
    empty = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    assert drafter.loss(empty, captured)[0].item() == 0.0


def test_trained_on_an_answer_it_drafts_that_answer(target, answer):
    """A few hundred real optimizer steps on one answer: the loss falls, and serving (chain and
    EAGLE-2 tree, feeding the head its own features) accepts nearly every draft, losslessly."""
    ids, reply, batch = answer
    drafter = make_drafter(target, vocab_over(target, reply))
    history = train_steps(drafter, batch, capture(target, drafter.vocab, batch, drafter.capture_layers()), 120)
    assert history[-1][0] < 0.3 * history[0][0] and history[-1][1] >= 0.9
    drafter.eval()
    chain, chain_stats = generate_spec(target, drafter, ids, 40, set(), steps=5)
    tree, tree_stats = generate_spec(target, drafter, ids, 40, set(), draft="tree", depth=5, topk=3, total=12)
    assert chain == tree == reply
    assert chain_stats.accept_len >= 4.0 and tree_stats.accept_len >= 4.0  # 5.0 is the most possible


@pytest.mark.parametrize("options", [dict(steps=6), dict(steps=6, min_confidence=0.05),
                                     dict(draft="tree", depth=4, topk=3, total=10)])
def test_untrained_head_serves_losslessly(target, options):
    drafter = make_drafter(target, vocab_over(target, list(range(0, 40000, 7)), 2048)).eval()
    for text, plain in plain_replies(target).items():
        assert generate_spec(target, drafter, chat_ids(target, text), 24, set(), **options)[0] == plain


def test_artifacts_native_vllm_sglang(target, answer, tmp_path):
    ids, reply, _ = answer
    drafter = make_drafter(target, vocab_over(target, reply)).eval()
    saved_drafter = native_round_trip(drafter, train_cfg().target, target, ids, tmp_path / "native")

    # SGLang: the EAGLE repo's names, a zero fc bias, the draft vocabulary as FR-Spec's token map
    config, weights = write_format(saved_drafter, "sglang", tmp_path / "sglang")
    assert config.architectures == ["LlamaForCausalLMEagle"] and config.num_hidden_layers == 1
    assert torch.equal(weights["layers.0.self_attn.q_proj.weight"],
                       saved_drafter.weights["midlayer.self_attn.q_proj.weight"])
    assert not torch.any(weights["fc.bias"]) and "layers.0.input_layernorm.weight" not in weights
    assert not any(name.startswith(("embed_tokens", "lm_head", "target_norm", "midlayer", "d2t")) for name in weights)
    assert torch.equal(torch.load(tmp_path / "sglang" / "token_map.pt"), saved_drafter.vocab().draft_ids)

    # vLLM has no draft-vocabulary map for EAGLE-1: refused unless the vocabulary is the whole one
    with pytest.raises(UserError, match="drafter.draft_vocab_size=49152"):
        formats.writer("vllm", "eagle").write_checked(saved_drafter, str(tmp_path / "refused"), "test")
    full = saved(make_drafter(target, vocab_over(target, reply, target.spec.vocab_size)), train_cfg().target)
    config, vllm_weights = write_format(full, "vllm", tmp_path / "vllm")
    assert config.architectures == ["LlamaForCausalLM"] and config.vocab_size == target.spec.vocab_size
    assert sorted(vllm_weights) == sorted(name for name in weights if name != "fc.bias")
    assert not os.path.exists(tmp_path / "vllm" / "token_map.pt")


def test_sglang_and_vllm_heads_read_back(target, answer, tmp_path):
    """What format=sglang (a draft vocabulary: token_map.pt) and format=vllm (the whole vocabulary)
    write reads back as the same drafter, drafting chains of EAGLE's depth by default."""
    ids, reply, _ = answer
    for fmt, size in [("sglang", 512), ("vllm", target.spec.vocab_size)]:
        drafter = make_drafter(target, vocab_over(target, reply, size)).eval()
        saved_drafter = saved(drafter, train_cfg().target)
        assert saved_drafter.proposal == {"draft": "chain", "steps": 3}
        write_format(saved_drafter, fmt, tmp_path / fmt)
        assert_read_back(tmp_path / fmt, saved_drafter, drafter, target, ids, train_cfg())


def test_eagle_repo_head_imports_with_its_fc_bias(target, answer, tmp_path):
    """A head as the EAGLE repo ships it (cnets1.py's names, a trained fc bias, the embedding,
    pytorch_model.bin) imports through export.run (default drafter=eagle3: the format decides) as an
    EAGLE-1 drafter with fc_bias, drafting what it drafts. vLLM's fc has no bias: format=vllm refuses it."""
    ids, reply, _ = answer
    drafter = make_drafter(target, vocab_over(target, reply, target.spec.vocab_size), "drafter.fc_bias=true").eval()
    with torch.no_grad():
        drafter.fc.bias.normal_(0, 0.1)
    original = saved(drafter, train_cfg().target)
    repo = tmp_path / "eagle"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **llama_fields(original),
                                                  "bias": True}))
    ours = {name: tensor for name, tensor in original.weights.items() if name.startswith(("fc.", "midlayer.", "embed"))}
    torch.save(renamed(ours, "midlayer.", "layers.0."), repo / "pytorch_model.bin")
    run_export(checkpoint=repo, format="native", target="tiny_llama", out=tmp_path / "native",
               **{"+target.random_init.initializer_range": 0.3})
    back = read(str(tmp_path / "native"))
    assert back.drafter == "eagle" and back.hparams["fc_bias"]
    assert back.hparams == json.loads(json.dumps(original.hparams))  # as JSON keeps them
    assert all(torch.equal(back.weights[name], tensor) for name, tensor in original.weights.items())
    assert_drafts_alike(back, drafter, target, ids)
    with pytest.raises(UserError, match="vLLM's EAGLE-1 fc has no bias and this head's has one"):
        formats.writer("vllm", "eagle").write_checked(back, str(tmp_path / "refused"), "test")


def test_bad_eagle1_heads_are_one_line_and_eagle3_heads_are_not_taken(target, answer, tmp_path):
    """Another target's head, two layers, unknown, missing or wrongly shaped tensors, a bad token map:
    one UserError line each."""
    _, reply, _ = answer
    saved_drafter = saved(make_drafter(target, vocab_over(target, reply)), train_cfg().target)
    config, weights = write_format(saved_drafter, "sglang", tmp_path / "sglang")
    width = target.spec.hidden_size
    for edit, message in [
        (lambda c, w: c.update(hidden_size=32), f"a head for hidden_size=32, the target {target.spec.name} has "),
        (lambda c, w: c.update(num_hidden_layers=2), "2 draft layers; our EAGLE-1 has one"),
        (lambda c, w: w.update({"layers.0.input_layernorm.weight": torch.ones(width)}),
         "unexpected weights \\['midlayer.input_layernorm.weight'\\]"),
        (lambda c, w: w.pop("layers.0.mlp.up_proj.weight"), "missing weights \\['midlayer.mlp.up_proj.weight'\\]"),
        (lambda c, w: w.update({"fc.weight": torch.zeros(width, width)}), "wrong shapes \\['fc.weight"),
    ]:
        with pytest.raises(UserError, match=message):
            imported(edited_head(tmp_path, config, weights, edit), target, train_cfg())
    torch.save(torch.tensor([3, 3]), tmp_path / "sglang" / "token_map.pt")
    with pytest.raises(UserError, match="the token map \\(2 ids\\) is no draft vocabulary"):
        imported(tmp_path / "sglang", target, train_cfg())
    # EAGLE-3 heads stay with EAGLE-3's readers; a one-layer Llama naming a draft vocabulary, or a whole
    # Llama, is no EAGLE-1 head
    for eagle3 in ({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1},
                   {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3"}):
        assert formats.reader(eagle3, "eagle3").drafter == "eagle3"
    for other in ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "draft_vocab_size": 32000},
                  {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30}):
        with pytest.raises(UserError, match="no layout this version reads"):
            formats.reader(other, "other")


@pytest.mark.slow
def test_smollm2_serves_losslessly_in_float32(smollm2_fp32_target):
    assert_lossless_on_smollm2(smollm2_fp32_target, "eagle", depth=4, topk=4, total=16)
