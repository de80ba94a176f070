"""Lossless speculative generation: the engine's greedy output equals plain greedy decoding."""

import pytest
import torch

from conftest import compose_train
from drafters.base import build_drafter
from drafters.vocab import build_draft_vocab
from serving.engine import generate_chain, generate_plain

PROMPTS = ["Explain KV caches in one paragraph.", "Write a haiku about the sea.", "What is 17 * 23?"]


def chat_ids(target, text):
    rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    return target.tokenizer(rendered, return_tensors="pt", add_special_tokens=False)["input_ids"]


def head_for(target, draft_size, seed=0):
    """An untrained EAGLE-3 head: it drafts mostly wrong tokens, the hard case for losslessness."""
    stream = torch.randint(0, target.spec.vocab_size, (20000,), generator=torch.Generator().manual_seed(seed)).tolist()
    vocab = build_draft_vocab([(stream, [1] * len(stream))], target.spec.vocab_size, draft_size, {"seed": seed})
    torch.manual_seed(seed)
    return build_drafter(compose_train().drafter, target, vocab).eval()


@pytest.fixture(scope="module")
def plain_outputs(tiny_target):
    eos = {tiny_target.tokenizer.eos_token_id}
    return {text: generate_plain(tiny_target, chat_ids(tiny_target, text), 32, eos) for text in PROMPTS}


@pytest.mark.parametrize("steps,min_prob", [(1, 0.0), (7, 0.0), (7, 0.2)])
def test_chain_equals_plain_greedy_on_tiny_target(tiny_target, plain_outputs, steps, min_prob):
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    for text in PROMPTS:
        ids = chat_ids(tiny_target, text)
        plain, plain_stats = plain_outputs[text]
        spec, stats = generate_chain(tiny_target, drafter, ids, 32, eos, steps=steps, min_prob=min_prob)
        assert spec == plain
        assert stats.new_tokens == len(plain) and plain_stats.accept_len == 1.0
        assert 1.0 <= stats.accept_len <= steps + 1


def test_acceptance_bookkeeping(tiny_target):
    """Per-position counts: a draft is only accepted after its predecessor was."""
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    ids = chat_ids(tiny_target, PROMPTS[0])
    _, stats = generate_chain(tiny_target, drafter, ids, 30, eos, steps=3)
    assert sum(stats.proposed_by_pos) >= 1
    assert all(a <= p for a, p in zip(stats.accepted_by_pos, stats.proposed_by_pos))
    # acceptance is monotone along the chain: a draft is only accepted after its predecessor
    assert stats.accepted_by_pos == sorted(stats.accepted_by_pos, reverse=True)


def test_max_new_tokens_and_eos_stop_like_plain(tiny_target):
    drafter = head_for(tiny_target, 2048)
    ids = chat_ids(tiny_target, PROMPTS[1])
    plain, _ = generate_plain(tiny_target, ids, 25, set())
    stop = {plain[9]}  # pretend the 10th token is EOS: both must stop right after its first use
    expected = plain[: plain.index(plain[9]) + 1]
    for max_new in (1, 2, 5):
        assert generate_chain(tiny_target, drafter, ids, max_new, set(), steps=4)[0] == plain[:max_new]
    assert generate_plain(tiny_target, ids, 25, stop)[0] == expected
    assert generate_chain(tiny_target, drafter, ids, 25, stop, steps=4)[0] == expected
