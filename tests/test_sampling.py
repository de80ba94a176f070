"""Speculative sampling keeps the target's distribution, end to end through the engine.

An 8-token target and a random EAGLE-3 head (its draft distribution differs from the target's, so
drafts are both accepted and rejected). The joint distribution of the first three generated tokens
over many engine runs must match the target's exact one (chi-square, p >= 0.001): token 1 comes
from prefill, tokens 2 and 3 through draft + rejection-sampling verification. The pair (token 1,
token 2) is checked on its own too: 64 cells instead of 512, so a bias at the first draft shows
with fewer runs.

How many runs: dropping the residual correction (the bonus drawn from p instead of norm(p - q)+)
fails the joint check at 3,000 runs (p = 1e-57); a 10% over-acceptance or a residual off by 10%
of q passes it at 10,000-20,000 runs, and by the chi-square's measured excess would at 100,000
too (issue 12's notes), so the count trades little power for CI time.
"""

import pytest
import torch

from conftest import CHI2_MIN_PVALUE, TOY_PROMPT, TOY_VOCAB, chi2_pvalue, compose_train, encode, exact_joint
from drafters.base import build_drafter
from drafters.target.model import load_target
from drafters.target.vocab import build_draft_vocab
from serving.engine import Sampler, generate_plain, generate_spec
from serving.schedule import AutoSchedule


@pytest.fixture(scope="module")
def small_vocab():
    cfg = compose_train(["target=tiny_llama", f"target.random_init.vocab_size={TOY_VOCAB}", "target.draft_vocab_size=6",
                         "target.random_init.num_hidden_layers=2", "drafter.aux_layers=[0,1,2]"])
    torch.manual_seed(0)
    target = load_target(cfg.target)
    # a draft vocabulary without tokens 0 and 1: the head can never propose them
    stream = [2, 3, 4, 5, 6, 7] * 10
    vocab = build_draft_vocab([(stream, [1] * len(stream))], TOY_VOCAB, 6, {"test": "sampling"})
    torch.manual_seed(1)
    drafter = build_drafter(cfg.drafter, target, vocab).eval()
    with torch.no_grad():
        drafter.lm_head.weight.normal_(0, 0.3)  # opinionated drafts that often disagree with the target
    return target, drafter


@pytest.fixture
def one_thread():
    """Thousands of tiny generations: one intra-op thread is much faster, and on a busy machine a second
    thread's spin-waiting makes each run ~25x slower (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.statistical
# a chain at T=1 over the most runs; top-p + dynamic draft length, a sampled tree (i.i.d. children,
# duplicates included) and n-gram drafts over fewer, to keep CI short (~20 ms a run on a 2-core AVX2 CPU)
@pytest.mark.parametrize("temperature,top_p,options,draws", [
    (1.0, 1.0, dict(steps=2), 30_000),
    (0.7, 0.8, dict(steps=2, min_confidence=0.3), 6_000),
    (1.0, 1.0, dict(draft="tree", depth=2, topk=2, total=5), 6_000),
    (1.0, 1.0, dict(draft="ngram"), 6_000),  # copied drafts, each a point mass
    # one source per forward (the copied drafts where the lookup finds some), chosen from earlier tokens only
    (1.0, 1.0, dict(draft="hybrid", steps=2), 6_000),
    # ...or none (a plain step) when scheduled
    (1.0, 1.0, dict(draft="hybrid", steps=2, schedule=AutoSchedule([0.0, 1.0, 1.05, 1.1, 1.15, 1.2], steps=2)), 6_000),
])
def test_spec_sampling_matches_target_distribution(small_vocab, one_thread, temperature, top_p, options, draws):
    target, drafter = small_vocab
    length = 3
    sampler = Sampler(temperature, top_p, torch.Generator().manual_seed(0))
    counts = torch.zeros(TOY_VOCAB**length)
    proposed = accepted = 0
    for _ in range(draws):
        tokens, stats = generate_spec(target, drafter, TOY_PROMPT, length, set(), sampler=sampler, **options)
        counts[encode(tokens)] += 1
        proposed += sum(stats.proposed_by_pos)
        accepted += sum(stats.accepted_by_pos)
    assert 0.1 < accepted / proposed < 0.9  # both the accept and the residual branch were taken
    joint = exact_joint(target, sampler, length)
    pair = counts.view(TOY_VOCAB**2, -1).sum(-1)  # (token 1, token 2)
    assert chi2_pvalue(pair, draws * joint.view(TOY_VOCAB**2, -1).sum(-1)) >= CHI2_MIN_PVALUE
    assert chi2_pvalue(counts, draws * joint) >= CHI2_MIN_PVALUE


def test_plain_sampling_is_seeded_and_nongreedy(small_vocab):
    target, _ = small_vocab
    runs = [generate_plain(target, TOY_PROMPT, 16, set(), Sampler(1.0, 1.0, torch.Generator().manual_seed(seed)))[0]
            for seed in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2]
    assert runs[0] != generate_plain(target, TOY_PROMPT, 16, set())[0]


def test_top_p_keeps_the_smallest_nucleus():
    probs = Sampler(1.0, 0.75).probs(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log())
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # the top token always survives, however small top_p is
    assert torch.equal(Sampler(1.0, 1e-6).probs(torch.tensor([[0.1, 2.0, 0.3]])), torch.tensor([[0.0, 1.0, 0.0]]))


def test_sampled_tree_keeps_every_draw_in_creation_order(small_vocab):
    target, drafter = small_vocab
    cache = drafter.new_cache()
    aux, _ = target.capture(TOY_PROMPT, None, drafter.capture_layers())
    feature, logits = drafter.extend(cache, aux, torch.cat([TOY_PROMPT[:, 1:], TOY_PROMPT[:, :1]], 1))
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    tokens, parents, dists = drafter.propose_tree(cache, feature, logits, 3, 2, 7, sampler.draw)
    # root: 2 children; level 2: both expanded, 2 draws each; level 3: the best 2 of those expanded,
    # the first of them fully kept (nodes 7, 8 would exceed total=7 after node 7)
    assert parents.tolist() == [0, 0, 1, 1, 2, 2, parents[6].item()] and parents[6] in (3, 4, 5, 6)
    # every node with children carries the distribution they were drawn from
    assert torch.allclose(dists[parents.unique()].sum(-1), torch.ones(len(parents.unique())))
    assert all(drafter.t2d[t] for t in tokens)  # target ids inside the draft vocabulary
