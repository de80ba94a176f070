"""N-gram drafts (serving/ngram.py) and the engine's draft=ngram / hybrid modes: lossless greedy output."""

import pytest

from conftest import FAMILIES, PROMPTS, chat_ids, head_for, random_drafter, vocab_over
from serving.engine import NgramOptions, generate_plain, generate_spec
from serving.ngram import NgramDrafts, merge
from serving.schedule import AutoSchedule


def test_longest_match_wins_and_the_most_recent_occurrence_first():
    #               0  1  2  3  4  5  6  7  8  9
    text = NgramDrafts([5, 6, 7, 1, 6, 7, 2, 9, 6, 7], longest=3)
    # suffix (6, 7) ends at 2, 5 and 9: the most recent earlier one (5) is followed by 2, 9, 6
    assert text.propose(3) == ([2, 9, 6], [0, 1, 2], 2)
    # two branches: the continuation of the older match (ending at 2) joins as a second branch
    assert text.propose(2, branches=2) == ([2, 9, 1, 6], [0, 1, 0, 3], 2)
    text.extend([2])  # (6, 7, 2) now matches at 6 with three tokens, beating any shorter match
    assert text.propose(2) == ([9, 6], [0, 1], 3)


def test_no_match_proposes_nothing_and_shortest_is_respected():
    assert NgramDrafts([1, 2, 3, 4]).propose(5) == ([], [], 0)
    text = NgramDrafts([3, 8, 4, 3])
    assert text.propose(2) == ([8, 4], [0, 1], 1)
    assert NgramDrafts([3, 8, 4, 3], shortest=2).propose(2) == ([], [], 0)


def test_branches_sharing_a_prefix_merge_into_a_trie():
    text = NgramDrafts([4, 1, 2, 9, 4, 1, 2, 8, 4])
    # after 4: "1 2 8" (recent) and "1 2 9" share "1 2"
    assert text.propose(3, branches=2) == ([1, 2, 8, 9], [0, 1, 2, 2], 1)


def test_earlier_text_matches_after_the_own_text_and_is_told_apart():
    earlier = NgramDrafts([], longest=3)
    earlier.extend([7, 8, 9, 4, 5])  # an earlier request: 8 9 was followed by 4 5
    text = NgramDrafts([1, 8, 9], longest=3, earlier=earlier)
    assert text.propose(2) == ([4, 5], [0, 1], -2)  # a 2-token match there, negated
    text.extend([6, 8, 9])  # now the own text has 8 9 too (followed by 6): same length, own text first
    assert text.propose(2) == ([6, 8], [0, 1], 2)
    assert text.propose(2, branches=2) == ([6, 8, 4, 5], [0, 1, 0, 3], 2)
    # a single token never matches in the earlier text: 5 occurs there only
    assert NgramDrafts([3, 5], earlier=earlier).propose(2) == ([], [], 0)


def test_merge_grafts_onto_the_same_root_and_shares_prefixes():
    tokens, parents = merge([5, 6, 7], [0, 1, 2], [5, 6, 9, 3], [0, 1, 2, 0])
    assert tokens == [5, 6, 7, 9, 3]
    assert parents == [0, 1, 2, 2, 0]


@pytest.fixture(scope="module")
def plain_outputs(tiny_target):
    eos = {tiny_target.tokenizer.eos_token_id}
    return {text: generate_plain(tiny_target, chat_ids(tiny_target, text), 48, eos)[0] for text in PROMPTS}


@pytest.mark.parametrize("options", [NgramOptions(), NgramOptions(longest=2, branches=3, length=4)])
def test_ngram_without_a_head_equals_plain_greedy(tiny_target, plain_outputs, options):
    eos = {tiny_target.tokenizer.eos_token_id}
    forwards = tokens = 0
    for text in PROMPTS:
        spec, stats = generate_spec(tiny_target, None, chat_ids(tiny_target, text), 48, eos, draft="ngram", ngram=options)
        assert spec == plain_outputs[text]
        forwards, tokens = forwards + stats.target_forwards, tokens + stats.new_tokens
    # a random tiny target repeats itself: copied drafts are accepted
    assert tokens / forwards > 1.2


@pytest.mark.parametrize("head", ["chain", "tree"])
def test_hybrid_equals_plain_greedy(tiny_target, plain_outputs, head):
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    for text in PROMPTS:
        spec, stats = generate_spec(tiny_target, drafter, chat_ids(tiny_target, text), 48, eos, draft="hybrid",
                                    steps=3, depth=3, topk=2, total=6, ngram=NgramOptions(branches=2, head=head))
        assert spec == plain_outputs[text]
        assert stats.accept_len > 1.0  # the untrained head alone accepts ~nothing; the n-gram branches do


@pytest.mark.parametrize("name,head", [(name, head) for name in FAMILIES for head in ("chain", "tree")
                                       if (name, head) != ("dspark", "tree")])  # DSpark drafts chains only
def test_hybrid_with_every_drafter_equals_plain_greedy(tiny_target, plain_outputs, name, head):
    stream = [token for text in PROMPTS for token in plain_outputs[text]]  # a vocabulary its drafts can hit
    drafter = random_drafter(name, tiny_target, vocab_over(tiny_target, stream, 256)).eval()
    eos = {tiny_target.tokenizer.eos_token_id}
    for text in PROMPTS:
        spec, _ = generate_spec(tiny_target, drafter, chat_ids(tiny_target, text), 48, eos, draft="hybrid",
                                steps=3, depth=3, topk=2, total=6, ngram=NgramOptions(branches=2, head=head))
        assert spec == plain_outputs[text]


def test_earlier_answers_are_copied_across_calls_losslessly(tiny_target, plain_outputs):
    eos = {tiny_target.tokenizer.eos_token_id}
    earlier = NgramDrafts([])
    first = chat_ids(tiny_target, PROMPTS[0])
    alone = generate_spec(tiny_target, None, first, 48, eos, draft="ngram")[1].target_forwards
    for _ in range(2):  # the same request twice: the second copies the first answer
        spec, stats = generate_spec(tiny_target, None, first, 48, eos, draft="ngram", earlier=earlier)
        assert spec == plain_outputs[PROMPTS[0]]
    assert len(earlier.tokens) == 2 * (first.shape[1] + len(spec))
    assert stats.target_forwards < alone
    for text in PROMPTS[1:]:
        assert generate_spec(tiny_target, None, chat_ids(tiny_target, text), 48, eos, draft="ngram",
                             earlier=earlier)[0] == plain_outputs[text]


COST = [0.0] + [1.0 + 0.05 * n for n in range(1, 24)]  # seconds of a forward over n tokens: drafts are cheap


@pytest.mark.parametrize("draft", ["chain", "ngram", "hybrid"])
def test_auto_schedule_equals_plain_greedy(tiny_target, plain_outputs, draft):
    drafter = head_for(tiny_target, 2048)
    eos = {tiny_target.tokenizer.eos_token_id}
    schedule = AutoSchedule(COST, steps=4)  # one for all prompts, as serving.bench keeps it
    for text in PROMPTS:
        spec, _ = generate_spec(tiny_target, drafter, chat_ids(tiny_target, text), 48, eos, draft=draft, steps=4,
                                schedule=schedule)
        assert spec == plain_outputs[text]


def test_auto_schedule_stops_running_a_useless_head_and_probes_it_ever_less():
    schedule = AutoSchedule(COST, steps=4)
    heads = []
    for _ in range(300):
        head_drafts, ngram_drafts = schedule.plan(True, 3, match=2)
        heads.append(head_drafts)
        if head_drafts:
            schedule.record_head([0.5] * head_drafts, 0, call_seconds=0.2, step_seconds=0.2)
        schedule.record_ngram(2, ngram_drafts, ngram_drafts)  # every n-gram draft accepted
    assert sum(heads[-150:]) <= 3  # probes only, at intervals that have grown to 64
    assert schedule.plan(True, 3, match=2)[1] == 3


def test_auto_schedule_probes_a_head_ever_less_when_its_accepted_drafts_do_not_pay():
    """A head accepted one probe in four, too slow to pay for that: an accepted probe must not
    bring the head back at every forward (it did: a reset to interval 1 on each accepted probe)."""
    schedule = AutoSchedule(COST, steps=4)
    heads, probes = [], 0
    for _ in range(400):
        head_drafts, _ = schedule.plan(True, 0, match=0)
        heads.append(head_drafts)
        if head_drafts:
            if schedule.probing:  # one draft, verified however unsure
                assert head_drafts == 1 and schedule.cut([0.01], 0) == 1
            probes += 1
            accepted = int(probes % 4 == 0)
            schedule.record_head([0.5] * head_drafts, min(accepted, head_drafts), call_seconds=0.5, step_seconds=0.5)
    assert sum(map(bool, heads[-200:])) <= 4, heads[-200:]
    assert probes >= 8  # and probed it still


def test_auto_schedule_drafts_long_chains_from_a_head_that_is_always_right():
    schedule = AutoSchedule(COST, steps=6)
    for _ in range(50):
        head_drafts, _ = schedule.plan(True, 0, match=0)
        schedule.record_head([0.9] * head_drafts, head_drafts, call_seconds=0.01, step_seconds=0.01)
    assert schedule.plan(True, 0, match=0) == (6, 0)
    assert schedule.plan(True, 0, match=0, both=False) == (6, 0)


def test_auto_schedule_verifies_the_head_drafts_its_calibrated_confidences_pay_for():
    schedule = AutoSchedule(COST, steps=6)
    for _ in range(100):  # confident drafts are accepted, unsure ones are not
        schedule.plan(True, 0, match=0)
        schedule.record_head([0.9, 0.9, 0.2], 2, call_seconds=0.01, step_seconds=0.01)
    assert schedule.calibration.rate(0.95) > 0.95 and schedule.calibration.rate(0.25) < 0.05
    assert schedule.plan(True, 0, match=0) == (6, 0)  # a head that runs may draft up to `steps`
    assert schedule.cut([0.9, 0.9, 0.9, 0.2, 0.9], 0) == 3
    assert not schedule.stop([0.9, 0.9], 0) and schedule.stop([0.9, 0.2], 0)


def test_auto_schedule_learns_a_call_cost_from_steady_extensions_not_catch_ups():
    """The first call of a prompt extends over the whole prompt, and a head that ran rarely catches
    up on every token since: counted as what each call costs, that made a useful head look too slow
    to run (measured: MT-bench, the long head drafted in 14% of forwards)."""
    schedule = AutoSchedule(COST, steps=4)
    for _ in range(10):
        schedule.plan(True, 0, match=0)
        schedule.record_head([0.9] * 4, 4, call_seconds=0.01, step_seconds=0.01, extended=5)
        schedule.plan(True, 0, match=0)
        schedule.record_head([0.9] * 4, 4, call_seconds=10.0, step_seconds=0.01, extended=200)
    assert schedule.head_call == pytest.approx(0.01)
    assert schedule.plan(True, 0, match=0) == (4, 0)


def test_auto_schedule_with_one_source_when_sampling():
    schedule = AutoSchedule(COST, steps=4)
    for _ in range(20):
        head_drafts, ngram_drafts = schedule.plan(True, 4, match=3, both=False)
        assert not (head_drafts and ngram_drafts)
        schedule.record_head([0.9] * max(head_drafts, 1), 1, call_seconds=0.01, step_seconds=0.01)
        schedule.record_ngram(3, ngram_drafts, ngram_drafts)


def test_auto_schedule_scales_every_token_count_with_what_it_measures():
    schedule = AutoSchedule(COST, steps=4)
    for _ in range(30):  # plain steps only, each twice as slow as at start-up (a longer context)
        schedule.record_forward(1, 2 * COST[1])
    assert schedule.cost(1) == pytest.approx(2 * COST[1], rel=0.01)
    assert schedule.cost(5) == pytest.approx(2 * COST[5], rel=0.01)  # unmeasured counts follow
