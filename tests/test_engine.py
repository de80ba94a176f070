"""Lossless speculative generation: the engine's greedy output equals plain greedy decoding."""

import pytest
import torch

from conftest import PROMPTS, chat_ids, head_for
from serving.engine import Stats, generate_spec, generate_plain

@pytest.fixture(scope="module")
def plain_outputs(tiny_target):
    eos = {tiny_target.tokenizer.eos_token_id}
    return {text: generate_plain(tiny_target, chat_ids(tiny_target, text), 32, eos) for text in PROMPTS}


@pytest.mark.parametrize("steps,min_confidence", [(1, 0.0), (7, 0.0), (7, 0.2)])
def test_chain_equals_plain_greedy_on_tiny_target(tiny_target, plain_outputs, steps, min_confidence):
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    for text in PROMPTS:
        ids = chat_ids(tiny_target, text)
        plain, plain_stats = plain_outputs[text]
        spec, stats = generate_spec(tiny_target, drafter, ids, 32, eos, steps=steps, min_confidence=min_confidence)
        assert spec == plain
        assert stats.new_tokens == len(plain) and plain_stats.accept_len == 1.0
        assert 1.0 <= stats.accept_len <= steps + 1


@pytest.mark.parametrize("depth,topk,total", [(2, 2, 3), (4, 3, 10), (6, 4, 24)])
def test_tree_equals_plain_greedy_on_tiny_target(tiny_target, plain_outputs, depth, topk, total):
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    for text in PROMPTS:
        spec, stats = generate_spec(tiny_target, drafter, chat_ids(tiny_target, text), 32, eos, draft="tree",
                                    depth=depth, topk=topk, total=total)
        assert spec == plain_outputs[text][0]
        assert 1.0 <= stats.accept_len <= depth + 1


class RecordingTree:
    """Wraps a drafter and records the depth the engine asks of each tree."""

    def __init__(self, drafter):
        self.drafter, self.depths = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose_tree(self, cache, feature, logits, depth, topk, total, draw=None):
        self.depths.append(depth)
        return self.drafter.propose_tree(cache, feature, logits, depth, topk, total, draw)


def test_every_tree_is_as_deep_as_asked(tiny_target):
    """A pruned tree (3 nodes of a depth-4 expansion) is shallower than `depth`; the next forward's
    tree must still be asked for `depth` levels (only the last few, near max_new_tokens, fewer)."""
    recorder = RecordingTree(head_for(tiny_target, 2048))
    depth = 4
    generate_spec(tiny_target, recorder, chat_ids(tiny_target, PROMPTS[0]), 32, set(), draft="tree",
                  depth=depth, topk=3, total=3)
    assert len(recorder.depths) > depth
    assert recorder.depths[: len(recorder.depths) - (depth - 1)] == [depth] * (len(recorder.depths) - (depth - 1))


def test_tree_proposal_shape_and_order(tiny_target):
    drafter = head_for(tiny_target, 2048)
    ids = chat_ids(tiny_target, PROMPTS[0])
    cache = drafter.new_cache()
    aux, _ = tiny_target.capture(ids, None, drafter.capture_layers())
    feature, logits = drafter.extend(cache, aux, torch.cat([ids[:, 1:], ids[:, :1]], 1))
    tokens, parents, dists = drafter.propose_tree(cache, feature, logits, depth=4, topk=3, total=10)
    assert dists is None  # greedy trees carry no sampling distributions
    assert tokens.shape == parents.shape == (10,)
    assert all(0 <= int(p) <= i for i, p in enumerate(parents))  # topological: parent before child
    assert bool(drafter.t2d[tokens].all())  # target ids of draft-vocabulary tokens
    assert cache.length > ids.shape[1]  # the proposal wrote speculative entries (the engine crops them)


def test_acceptance_bookkeeping(tiny_target):
    """Per-position counts: a draft is only accepted after its predecessor was."""
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    ids = chat_ids(tiny_target, PROMPTS[0])
    _, stats = generate_spec(tiny_target, drafter, ids, 30, eos, steps=3)
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
        assert generate_spec(tiny_target, drafter, ids, max_new, set(), steps=4)[0] == plain[:max_new]
    assert generate_plain(tiny_target, ids, 25, stop)[0] == expected
    assert generate_spec(tiny_target, drafter, ids, 25, stop, steps=4)[0] == expected


class OracleTree:
    """Wraps a drafter; its tree hides the target's true continuation in the SECOND branch, so the
    accepted path is non-contiguous and the engine must compact the target cache to stay lossless."""

    def __init__(self, drafter, prompt_length, continuation, vocab_size):
        self.drafter, self.prompt_length, self.continuation, self.vocab_size = drafter, prompt_length, continuation, vocab_size

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose_tree(self, cache, feature, logits, depth, topk, total, draw=None):
        start = cache.length - self.prompt_length + 1  # index of the next token to generate
        right = self.continuation[start : start + 4]
        right = right + [0] * (4 - len(right))
        wrong = [(t + 1) % self.vocab_size for t in right[:3]]
        tokens = torch.tensor(wrong + right)
        parents = torch.tensor([0, 1, 2, 0, 4, 5, 6])
        return tokens, parents, None


def test_tree_accepting_a_later_branch_compacts_the_cache(tiny_target, plain_outputs):
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    text = PROMPTS[0]
    plain = plain_outputs[text][0]
    ids = chat_ids(tiny_target, text)
    oracle = OracleTree(drafter, ids.shape[1], plain, tiny_target.spec.vocab_size)
    spec, stats = generate_spec(tiny_target, oracle, ids, 32, eos, draft="tree")
    assert spec == plain
    assert stats.accept_len >= 4.0  # 4 drafts + the bonus per forward (1 + 7 x 5 tokens, cut at 32)


def test_scheduled_length_threshold():
    from serving.engine import scheduled_length

    confidence = torch.tensor([0.9, 0.8, 0.5, 0.9])  # running product .9 .72 .36 .324
    assert scheduled_length(confidence) == 4
    assert scheduled_length(confidence, min_confidence=0.7) == 2
    assert scheduled_length(confidence, min_confidence=0.99) == 1  # never fewer than one draft


def test_auto_schedule_on_measured_costs_is_lossless(tiny_target, plain_outputs):
    from serving.engine import measure_verify_cost
    from serving.schedule import AutoSchedule

    drafter = head_for(tiny_target, 2048)
    cost = measure_verify_cost(tiny_target, drafter.capture_layers(), 8, context=16, repeats=2)
    assert len(cost) == 9 and cost[0] == 0.0 and all(seconds > 0 for seconds in cost[1:])
    eos, schedule = {tiny_target.tokenizer.eos_token_id}, AutoSchedule(cost, steps=7)
    for text, (plain, _) in plain_outputs.items():
        ids = chat_ids(tiny_target, text)
        spec, _ = generate_spec(tiny_target, drafter, ids, 32, eos, steps=7, schedule=schedule)
        assert spec == plain


def test_stats_add_sums_runs_position_by_position():
    """What serving.bench totals a prompt set with: counts and times summed, per-position counts
    summed position by position over runs whose chains had different lengths."""
    total, short, long = Stats(), Stats(new_tokens=5, target_forwards=3, seconds=0.5), Stats(new_tokens=9, target_forwards=4)
    short.count(2, 1)
    long.count(4, 3)
    long.count(1, 0)
    for run in (short, long):
        total.add(run)
    assert (total.new_tokens, total.target_forwards, total.seconds) == (14, 7, 0.5)
    assert total.proposed_by_pos == [3, 2, 1, 1] and total.accepted_by_pos == [2, 1, 1, 0]
    assert total.accept_len == 2.0
