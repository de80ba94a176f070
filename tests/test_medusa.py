"""Medusa (drafters/medusa.py): heads that start as the target's lm_head, the head-k offset of the
loss against a row-by-row reference, the best-first Cartesian tree against brute force, training
on one answer until serving accepts it (so serving reads the hidden state the heads were trained
on), lossless greedy serving, sampling that keeps the target's distribution, artifacts."""

import itertools
import json

import pytest
import torch

from conftest import (CHI2_MIN_PVALUE, TOY_PROMPT, TOY_VOCAB, VARIED_TARGET, assert_drafts_alike,
                      assert_lossless_on_smollm2, assert_read_back, chat_ids, chi2_pvalue, compose_train, conversation,
                      edited_head, imported, encode, exact_joint, native_round_trip, plain_replies, run_export, saved,
                      train_steps, vocab_over, write_format)
from drafters.base import build_drafter, capture
from drafters.config.errors import UserError
from drafters.proposal import best_nodes
from drafters.storage.artifact import read
from drafters.target.model import load_target
from export import formats
from serving.engine import Sampler, generate_spec

HEADS = 4


def train_cfg(*overrides):
    return compose_train([*VARIED_TARGET, "drafter=medusa", f"drafter.num_heads={HEADS}", *overrides])


def make_drafter(target, vocab, *overrides, seed=0):
    torch.manual_seed(seed)
    return build_drafter(train_cfg(*overrides).drafter, target, vocab)


@pytest.fixture(scope="module")
def target(varied_target):
    return varied_target


@pytest.fixture(scope="module")
def answer(target):
    return conversation(target)


def test_heads_start_as_the_target_lm_head(target, answer):
    _, reply, batch = answer
    vocab = vocab_over(target, reply)
    drafter = make_drafter(target, vocab)
    assert drafter.capture_layers() == [target.spec.num_layers]
    assert len(drafter.blocks) == len(drafter.lm_heads) == HEADS
    assert drafter.lm_heads[0].weight.shape == (vocab.draft_size, target.spec.hidden_size)
    assert not drafter.target_norm.weight.requires_grad
    # zero-initialized blocks + the target's rows: every head is the target's next-token head on h_t
    captured = capture(target, vocab, batch, drafter.capture_layers())
    logits = drafter.head_logits(drafter.hidden(captured.aux))
    taught = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1)).bool()  # where the teacher is computed
    for k in range(HEADS):
        torch.testing.assert_close(logits[..., k, :][taught], captured.teacher_logits[taught])


def test_head_k_is_trained_on_the_teacher_k_positions_ahead(target, answer):
    _, reply, batch = answer
    vocab = vocab_over(target, reply)
    drafter = make_drafter(target, vocab, "drafter.num_layers=2")
    with torch.no_grad():
        for parameter in drafter.blocks.parameters():
            parameter.normal_(0, 0.05)  # heads that differ from each other and from the target's
    generator = torch.Generator().manual_seed(0)
    batch = {**batch, "loss_mask": torch.randint(0, 2, batch["loss_mask"].shape, generator=generator)}
    captured = capture(target, vocab, batch, drafter.capture_layers())
    loss, metrics = drafter.loss(batch, captured)
    hidden = drafter.hidden(captured.aux)[0]
    length, expected = hidden.shape[0], 0.0
    for k in range(1, HEADS + 1):
        terms, hits = [], []
        for t in range(length - k - 1):  # the last position has no next token to learn from
            # h_t's head k guesses token t+1+k: the target's distribution of it is the teacher at t+k
            if batch["loss_mask"][0, t + k + 1] and captured.in_vocab[0, t + k]:
                logits = drafter.lm_heads[k - 1](drafter.blocks[k - 1](hidden[t]))
                teacher = torch.softmax(captured.teacher_logits[0, t + k].float(), -1)
                terms.append(-(teacher * torch.log_softmax(logits, -1)).sum())
                hits.append(float(logits.argmax() == captured.teacher_token[0, t + k]))
        assert terms
        torch.testing.assert_close(metrics[f"loss/{k}"], torch.stack(terms).mean().detach())
        assert metrics[f"acc/{k}"] == pytest.approx(sum(hits) / len(hits))
        expected = expected + 0.8 ** (k - 1) * torch.stack(terms).mean()
    torch.testing.assert_close(loss.detach(), expected.detach())
    empty = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    assert drafter.loss(empty, captured)[0].item() == 0.0


@pytest.mark.parametrize("depth,topk,total", [(1, 3, 2), (3, 2, 8), (4, 3, 20), (3, 4, 100)])
def test_best_nodes_are_the_most_likely_tree(depth, topk, total):
    generator = torch.Generator().manual_seed(depth * 10 + topk)
    # each head's `topk` best log-probabilities, best first
    log_probs = torch.log_softmax(torch.randn(depth, 50, generator=generator), -1).topk(topk).values.tolist()
    nodes = best_nodes(log_probs, total)
    paths = []  # each node's ranks from the root, through its parents
    for parent, level, rank in nodes:
        assert parent <= len(paths) and level == (len(paths[parent - 1]) if parent else 0)
        paths.append((paths[parent - 1] if parent else ()) + (rank,))
    everything = [path for length in range(1, depth + 1) for path in itertools.product(range(topk), repeat=length)]
    score = lambda path: sum(log_probs[level][rank] for level, rank in enumerate(path))  # noqa: E731
    assert len(set(paths)) == len(paths) == min(total, len(everything))
    best = sorted(map(score, everything), reverse=True)[:total]
    assert sorted(map(score, paths), reverse=True) == pytest.approx(best)


def test_tree_and_chain_proposals(target, answer):
    ids, reply, _ = answer
    drafter = make_drafter(target, vocab_over(target, reply)).eval()
    with torch.no_grad():
        for parameter in drafter.blocks.parameters():
            parameter.normal_(0, 0.05)
    cache = drafter.new_cache()
    aux, _ = target.capture(ids, None, drafter.capture_layers())
    feature, logits = drafter.extend(cache, aux, torch.cat([ids[:, 1:], ids[:, :1]], 1))
    assert logits.shape == (1, HEADS, drafter.vocab.draft_size)
    # the chain: each head's top token, no more drafts than heads however many are asked for
    chain, dists, _ = drafter.propose_chain(cache, feature, logits, 7)
    assert chain.shape == (1, HEADS) and dists.shape == (1, HEADS, drafter.vocab.draft_size)
    top = logits[0].topk(3).indices  # [heads, 3] draft ids
    assert torch.equal(chain[0], top[:, 0] + drafter.d2t[top[:, 0]])
    # greedy tree: level l takes head l+1's top tokens; no deeper than the heads
    tokens, parents, node_dists = drafter.propose_tree(cache, feature, logits, depth=6, topk=3, total=15)
    assert node_dists is None and tokens.shape == parents.shape == (15,)
    levels = []
    for node, parent in enumerate(parents.tolist()):
        assert parent <= node
        levels.append(levels[parent - 1] + 1 if parent else 0)
        assert tokens[node] in top[levels[-1]] + drafter.d2t[top[levels[-1]]]
    assert max(levels) < HEADS and tokens[0] == chain[0, 0]
    # sampling: a chain draws from each head's distribution, and reports it
    sampler = Sampler(0.7, 0.9, torch.Generator().manual_seed(0))
    sampled, dists, _ = drafter.propose_chain(cache, feature, logits, 7, sampler.draw)
    torch.testing.assert_close(dists[0], sampler.probs(logits[0]))
    draft_index = drafter.vocab.draft_ids.tolist().index
    assert all(dists[0, k, draft_index(int(sampled[0, k]))] > 0 for k in range(HEADS))  # inside the top-p cut
    # a sampled tree: the same shape, children drawn from the next head, its distribution recorded
    sampled, sampled_parents, node_dists = drafter.propose_tree(cache, feature, logits, 6, 3, 15, sampler.draw)
    assert torch.equal(sampled_parents, parents) and bool(drafter.t2d[sampled].all())
    torch.testing.assert_close(node_dists[0], sampler.probs(logits[0, 0]))
    for node, level in enumerate(levels, 1):
        # a leaf level's nodes have no children: nothing was drawn for them
        expected = sampler.probs(logits[0, level + 1]) if level < max(levels) else torch.zeros_like(node_dists[0])
        torch.testing.assert_close(node_dists[node], expected)
    assert cache.length == 0  # Medusa keeps nothing between steps


def test_trained_on_an_answer_it_drafts_that_answer(target, answer):
    """Real optimizer steps on one answer: the loss falls, and serving accepts nearly every draft,
    which it only does if it hands the heads the hidden state they were trained on (h_t before
    the bonus token, heads guessing the tokens after it)."""
    ids, reply, batch = answer
    drafter = make_drafter(target, vocab_over(target, reply))
    captured = capture(target, drafter.vocab, batch, drafter.capture_layers())
    history = train_steps(drafter, batch, captured, 50)
    metrics = drafter.loss(batch, captured)[1]
    assert history[-1][0] < 0.5 * history[0][0] and all(metrics[f"acc/{k}"] >= 0.9 for k in range(1, HEADS + 1))
    drafter.eval()
    chain, chain_stats = generate_spec(target, drafter, ids, 40, set(), steps=HEADS)
    tree, tree_stats = generate_spec(target, drafter, ids, 40, set(), draft="tree", depth=HEADS, topk=3, total=12)
    assert chain == tree == reply
    assert chain_stats.accept_len >= 4.0 and tree_stats.accept_len >= 4.0  # 40 tokens in 9 forwards at best: 4.44


# steps=7 asks for more drafts than there are heads, depth=6 for more levels
@pytest.mark.parametrize("options", [dict(steps=7), dict(steps=3, min_confidence=0.05),
                                     dict(draft="tree", depth=6, topk=3, total=10)])
def test_untrained_heads_serve_losslessly(target, options):
    drafter = make_drafter(target, vocab_over(target, list(range(0, 40000, 7)), 2048)).eval()
    for text, plain in plain_replies(target).items():
        assert generate_spec(target, drafter, chat_ids(target, text), 24, set(), **options)[0] == plain


@pytest.mark.statistical
def test_sampled_tree_keeps_the_target_distribution():
    """Two generated tokens over many runs against the target's exact joint distribution: token 2
    is one of head 1's i.i.d. drafts (two siblings) or the residual of rejection sampling. (A chain
    draws each head once from the distribution it reports: test_tree_and_chain_proposals.)"""
    cfg = compose_train(["target=tiny_llama", f"target.random_init.vocab_size={TOY_VOCAB}", "drafter=medusa",
                         "target.random_init.num_hidden_layers=2", "drafter.num_heads=2"])
    small = load_target(cfg.target)
    vocab = vocab_over(small, [2, 3, 4, 5, 6, 7] * 10, 6)  # tokens 0 and 1 can never be drafted
    torch.manual_seed(1)
    drafter = build_drafter(cfg.drafter, small, vocab).eval()
    with torch.no_grad():
        for head in drafter.lm_heads:
            head.weight.normal_(0, 0.5)  # drafts that often disagree with the target
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    runs, counts, accepted = 4000, torch.zeros(TOY_VOCAB * TOY_VOCAB), 0
    for _ in range(runs):
        tokens, stats = generate_spec(small, drafter, TOY_PROMPT, 2, set(), sampler=sampler, draft="tree", depth=2,
                                      topk=2, total=5)
        counts[encode(tokens)] += 1
        accepted += sum(stats.accepted_by_pos)
    assert 0.1 * runs < accepted < 0.9 * runs  # both accepted and rejected drafts
    with torch.no_grad():
        expected = runs * exact_joint(small, sampler, 2)
    assert chi2_pvalue(counts, expected) >= CHI2_MIN_PVALUE


def test_bad_head_count_is_one_clear_line(target):
    with pytest.raises(UserError, match="drafter.num_heads=0"):
        make_drafter(target, vocab_over(target, [1, 2, 3]), "drafter.num_heads=0")


def test_artifacts_native_and_vllm(target, answer, tmp_path):
    ids, reply, _ = answer
    drafter = make_drafter(target, vocab_over(target, reply)).eval()
    saved_drafter = native_round_trip(drafter, train_cfg().target, target, ids, tmp_path / "native")
    with pytest.raises(UserError, match="format=vllm: vLLM serves Medusa heads over the target's whole vocabulary"):
        write_format(saved_drafter, "vllm", tmp_path / "refused")  # vLLM 0.32 fails to load a token_map
    whole = saved(make_drafter(target, vocab_over(target, reply, target.spec.vocab_size)).eval(), train_cfg().target)
    config, weights = write_format(whole, "vllm", tmp_path / "vllm")
    assert (config.model_type, config.num_heads, config.num_hidden_layers) == ("medusa", HEADS, 1)
    assert config.vocab_size == config.truncated_vocab_size == target.spec.vocab_size
    expected = {f"blocks.{k}.layers.0.{p}" for k in range(HEADS) for p in ("weight", "bias")}
    assert set(weights) == expected | {f"lm_heads.{k}.weight" for k in range(HEADS)}
    with pytest.raises(UserError, match="has no writer for drafter 'medusa'"):
        formats.writer("sglang", "medusa")


def token_map_layout(saved_drafter, spec) -> tuple[dict, dict]:
    """vLLM's Medusa layout of a head with a draft vocabulary (`truncated_vocab_size` and `token_map`,
    the target id of each draft token), as heads made elsewhere come: format=vllm does not write it."""
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": spec.hidden_size,
              "vocab_size": spec.vocab_size, "num_heads": HEADS, "num_hidden_layers": 1, "medusa_fc_bias": True,
              "truncated_vocab_size": saved_drafter.hparams["draft_vocab_size"]}
    weights = {name: tensor for name, tensor in saved_drafter.weights.items() if name.startswith(("blocks.", "lm_heads."))}
    return config, weights | {"token_map": saved_drafter.vocab().draft_ids}


def trained_looking(drafter):
    """Blocks with weights (zero-initialized ones would hide a misplaced block); biases stay zero."""
    with torch.no_grad():
        for block in drafter.blocks:
            for layer in block.layers:
                layer.weight.normal_(0, 0.05)
    return drafter.eval()


def test_vllm_heads_read_back(target, answer, tmp_path):
    """vLLM's layout with a draft vocabulary (token_map) reads back as the same drafter, drafting one
    token per head by default; so do its variants: a token map in another order, an lm_head over
    the whole vocabulary (vLLM takes the token map's rows), blocks without biases (medusa_fc_bias=false)."""
    ids, reply, _ = answer
    drafter = trained_looking(make_drafter(target, vocab_over(target, reply)))
    saved_drafter = saved(drafter, train_cfg().target)
    assert saved_drafter.proposal == {"draft": "chain", "steps": HEADS}
    config, weights = token_map_layout(saved_drafter, target.spec)
    assert_read_back(edited_head(tmp_path, config, weights, lambda *_: None), saved_drafter, drafter, target, ids,
                     train_cfg())

    def variants(config, weights):
        order = torch.randperm(len(weights["token_map"]), generator=torch.Generator().manual_seed(0))
        for name in [name for name in weights if name.endswith(".bias")]:
            del weights[name]
        for name in ["token_map", *(f"lm_heads.{k}.weight" for k in range(HEADS))]:
            weights[name] = weights[name][order]  # the draft tokens in another order
        whole = torch.zeros(target.spec.vocab_size, target.spec.hidden_size)
        weights["lm_heads.1.weight"] = whole.index_copy(0, weights["token_map"], weights["lm_heads.1.weight"])
        config["medusa_fc_bias"] = False

    assert_read_back(edited_head(tmp_path, config, weights, variants), saved_drafter, drafter, target, ids, train_cfg())


def test_medusa_repo_head_imports(target, answer, tmp_path):
    """A head as the Medusa repo ships it (config medusa_num_heads / medusa_num_layers;
    medusa_lm_head.pt: per head the ResBlocks `{k}.{j}.linear.*`, then the lm_head `{k}.{layers}.weight`
    over the whole vocabulary) imports through export.run (default drafter=eagle3: the format decides)."""
    ids, reply, _ = answer
    drafter = trained_looking(make_drafter(target, vocab_over(target, reply, target.spec.vocab_size),
                                           "drafter.num_layers=2"))
    original = saved(drafter, train_cfg().target)
    repo = tmp_path / "medusa"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS, "medusa_num_layers": 2,
                                                  "base_model_name_or_path": "org/tiny-llama"}))
    heads = {f"{k}.2.weight": original.weights[f"lm_heads.{k}.weight"] for k in range(HEADS)}
    blocks = {f"{k}.{j}.linear.{kind}": original.weights[f"blocks.{k}.layers.{j}.{kind}"]
              for k in range(HEADS) for j in range(2) for kind in ("weight", "bias")}
    torch.save({**blocks, **heads}, repo / "medusa_lm_head.pt")
    run_export(checkpoint=repo, format="native", target="tiny_llama", out=tmp_path / "native",
               **{"+target.random_init.initializer_range": 0.3})
    back = read(str(tmp_path / "native"))
    assert (back.drafter, back.hparams, back.proposal) == ("medusa", original.hparams, original.proposal)
    assert all(torch.equal(back.weights[name], tensor) for name, tensor in original.weights.items())
    assert_drafts_alike(back, drafter, target, ids)


def test_bad_medusa_heads_are_one_line(target, answer, tmp_path):
    """Another target's head, a config naming more heads than the files hold, unknown tensors, wrong
    shapes, a bad token map, no weights: one UserError line each."""
    _, reply, _ = answer
    config, weights = token_map_layout(saved(make_drafter(target, vocab_over(target, reply)), train_cfg().target),
                                       target.spec)
    width = target.spec.hidden_size
    for edit, message in [
        (lambda c, w: c.update(hidden_size=32), f"a head for hidden_size=32, the target {target.spec.name} has"),
        (lambda c, w: c.update(num_heads=HEADS + 1),  # a head more than the files hold
         f"missing weights \\['blocks.{HEADS}.layers.0.bias', 'blocks.{HEADS}.layers.0.weight', 'lm_heads.{HEADS}"),
        (lambda c, w: w.update({"blocks.0.norm.weight": torch.ones(width)}),
         "unexpected weights \\['blocks.0.norm.weight'\\]"),
        (lambda c, w: w.update({"lm_heads.0.weight": torch.zeros(7, width)}),
         "wrong shapes \\['lm_heads.0.weight \\[7, "),
        (lambda c, w: w.update(token_map=torch.tensor([-1, 2])), "the token map \\(2 ids\\) is no draft vocabulary"),
    ]:
        with pytest.raises(UserError, match=message):
            imported(edited_head(tmp_path, config, weights, edit), target, train_cfg())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(UserError, match="no weights \\(\\*.safetensors or \\*.pt\\)"):
        imported(tmp_path / "empty", target, train_cfg())


@pytest.mark.slow
def test_smollm2_serves_losslessly_in_float32(smollm2_fp32_target):
    assert_lossless_on_smollm2(smollm2_fp32_target, "medusa", depth=5, topk=4, total=16)
