"""DFlash and DSpark (drafters/dflash.py, drafters/dspark.py): block masks and anchors against the
serving path, the Markov head, confidence calibration, training, lossless greedy serving (chain,
block with confidence scheduling, tree), exact sampling, native artifacts, SmolLM2."""

import pytest
import torch
import torch.nn.functional as F

from conftest import (CHI2_MIN_PVALUE, PROMPTS, TOY_PROMPT, TOY_VOCAB, VARIED_TARGET, assert_lossless_on_smollm2,
                      chat_ids, chi2_pvalue, compose_train, encode, exact_joint, native_round_trip, plain_replies,
                      self_distilled_batch, train_steps, vocab_over)
from drafters.base import build_drafter, capture
from drafters.config.errors import UserError
from drafters.target.model import load_target
from serving.engine import Sampler, generate_plain, generate_spec


def make_drafter(target, vocab, name="dflash", *overrides, seed=0):
    torch.manual_seed(seed)
    return build_drafter(compose_train([*VARIED_TARGET, f"drafter={name}", *overrides]).drafter, target, vocab)


@pytest.fixture(scope="module")
def target(varied_target):
    return varied_target


@pytest.fixture(scope="module")
def data(target):
    """Self-distilled sequences (trained on), held-out ones, and a vocabulary covering both."""
    train, held_out = self_distilled_batch(target, 4, 48, seed=0), self_distilled_batch(target, 4, 48, seed=1)
    tokens = torch.cat([train["input_ids"], held_out["input_ids"]]).flatten().tolist()
    return train, held_out, vocab_over(target, tokens, 1024)


def test_layout_and_frozen_parts(target, data):
    drafter = make_drafter(target, data[2])
    assert drafter.capture_layers() == [1, 2, 3, 4, 5]  # spread over 1..N-3 of the 8-layer target
    assert drafter.fc.weight.shape == (target.spec.hidden_size, 5 * target.spec.hidden_size)
    assert drafter.mask_token_id == target.spec.vocab_size - 1 and drafter.block_size == 8
    trainable = {name.split(".")[0] for name, p in drafter.named_parameters() if p.requires_grad}
    assert trainable == {"fc", "hidden_norm", "layers", "norm", "lm_head"}
    assert torch.equal(drafter.embed_tokens.weight, target.embed_weight.float())
    spark = make_drafter(target, data[2], "dspark", "drafter.markov_rank=16")
    assert spark.markov_head.markov_w1.weight.shape == (target.spec.vocab_size, 16)
    assert spark.confidence_head.proj.weight.shape == (1, target.spec.hidden_size + 16)


def test_anchors_are_distinct_trained_positions_whose_blocks_fit(target, data):
    drafter = make_drafter(target, data[2], "dflash", "drafter.blocks_per_sequence=6")
    predicts = torch.zeros(2, 30, dtype=torch.bool)
    predicts[0, [0, 3, 9, 22, 23, 24, 29]] = True  # 0 has no context; 24+ leave no room for the block
    predicts[1, 5:20] = True
    anchors, real = drafter.sample_anchors(predicts)
    assert anchors.shape == (2, 6)
    assert sorted(anchors[0][real[0]].tolist()) == [3, 9, 22, 23] and real[1].all()
    assert len(set(anchors[1].tolist())) == 6 and all(5 <= a < 20 for a in anchors[1].tolist())


def test_training_blocks_compute_what_serving_computes(target, data):
    """Each training block (random anchor, the shared context masked to before it) gives the same
    slot states as serving: the context up to the anchor added to the cache, the anchor token
    committed, one block forward."""
    train, _, vocab = data
    drafter = make_drafter(target, vocab, "dflash", "drafter.blocks_per_sequence=5").eval()
    captured = capture(target, vocab, train, drafter.capture_layers())
    torch.manual_seed(3)
    anchors, real = drafter.sample_anchors(F.pad(train["loss_mask"][:, 1:], (0, 1)).bool() & captured.in_vocab)
    drafter.sample_anchors = lambda predicts: (anchors, real)
    rows = drafter.block_rows(train, captured)
    seen = 0
    for row in range(train["input_ids"].shape[0]):
        for anchor in anchors[row][real[row]].tolist():
            ids = train["input_ids"][row : row + 1, : anchor + 1]
            with torch.no_grad():
                hidden = drafter.block_hidden(drafter.new_cache(), [a[row : row + 1, :anchor] for a in captured.aux],
                                              ids[:, 1:])
            trained = rows.previous[seen : seen + 7]  # data tokens before the drafted ones: anchor .. anchor+6
            assert trained.tolist() == train["input_ids"][row, anchor : anchor + 7].tolist()
            torch.testing.assert_close(rows.hidden[seen : seen + 7], hidden[0, 1:], rtol=1e-4, atol=1e-4)
            seen += 7
    assert seen == len(rows.slot) > 0


def test_loss_is_the_slot_decayed_cross_entropy(target, data):
    """loss = sum_j w_j mean_j(CE) / sum_j w_j with w_j = exp(-(j-1)/gamma), over the slots present."""
    train, _, vocab = data
    drafter = make_drafter(target, vocab, "dflash", "drafter.loss_gamma=2.0").eval()
    captured = capture(target, vocab, train, drafter.capture_layers())
    fixed = drafter.sample_anchors(F.pad(train["loss_mask"][:, 1:], (0, 1)).bool() & captured.in_vocab)
    drafter.sample_anchors = lambda predicts: fixed
    loss, metrics = drafter.loss(train, captured)
    rows = drafter.block_rows(train, captured)
    per_row = F.cross_entropy(drafter.lm_head(rows.hidden).float(), rows.teacher, reduction="none")
    means = torch.stack([per_row[rows.slot == j].mean() for j in range(1, 8)])
    weights = torch.exp(-torch.arange(7) / 2.0)
    torch.testing.assert_close(loss, (weights * means).sum() / weights.sum())
    assert [metrics[f"loss/{j}"] for j in range(1, 8)] == pytest.approx(means.tolist(), rel=1e-5)


@pytest.mark.long
@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_training_lowers_the_loss_and_serving_stays_lossless(target, data, name):
    """Real optimizer steps on self-distilled data: the loss falls, slot 1 learns the target's
    tokens, and the trained head serves greedily token-for-token like plain decoding (block, block
    with confidence scheduling, and for DFlash a tree), accepting several drafts per forward."""
    train, _, vocab = data
    drafter = make_drafter(target, vocab, name)
    history = train_steps(drafter, train, capture(target, vocab, train, drafter.capture_layers()), 60)
    assert history[-1][0] < 0.5 * history[0][0] and history[-1][1] >= 0.9
    drafter.eval()
    ids = train["input_ids"][:1, :8]
    plain, _ = generate_plain(target, ids, 40, set())
    options = [dict(steps=7), dict(steps=7, min_confidence=0.5)]
    if name == "dflash":
        options.append(dict(draft="tree", depth=7, topk=2, total=14))
    stats = {}
    for option in options:
        tokens, stats[str(option)] = generate_spec(target, drafter, ids, 40, set(), **option)
        assert tokens == plain, option
    block, scheduled = stats[str(options[0])], stats[str(options[1])]
    assert block.accept_len >= 3.0 and stats[str(options[-1])].accept_len >= 3.0
    # the schedule verifies no more drafts per forward than the block; DSpark's confidence head has
    # learnt these drafts are right, so it keeps them (DFlash's top probabilities stay low: the
    # target's distributions are flat, and a product of them falls below 0.5 within a few slots)
    assert sum(scheduled.proposed_by_pos) / scheduled.target_forwards <= sum(block.proposed_by_pos) / block.target_forwards
    if name == "dspark":
        assert scheduled.accept_len >= 3.0


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_untrained_head_serves_losslessly(target, data, name):
    drafter = make_drafter(target, data[2], name).eval()
    for text, plain in plain_replies(target).items():
        assert generate_spec(target, drafter, chat_ids(target, text), 24, set(), steps=7)[0] == plain
        assert generate_spec(target, drafter, chat_ids(target, text), 24, set(), steps=5, min_confidence=0.2)[0] == plain


def test_markov_head_conditions_each_slot_on_the_draft_before_it(target, data):
    drafter = make_drafter(target, data[2], "dspark", "drafter.markov_rank=8").eval()
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 50.0)  # a bias strong enough to decide
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
    ids = chat_ids(target, PROMPTS[0])
    aux, _ = target.capture(ids, None, drafter.capture_layers())
    cache = drafter.new_cache()
    hidden, logits = drafter.extend(cache, aux, ids.roll(-1, 1))
    tokens, dists, confidence = drafter.propose_chain(cache, hidden, logits, 5)
    previous = cache.last_token[:, 0]  # slot 1's Markov input: the anchor, the last committed token
    for k in range(5):
        bias = drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(previous))
        expected = (logits[:, k] + bias).argmax(-1)
        assert tokens[:, k].tolist() == (expected + drafter.d2t[expected]).tolist()
        probe = drafter.confidence_head.proj(torch.cat([hidden[:, k], drafter.markov_head.markov_w1(previous)], -1))
        torch.testing.assert_close(confidence[:, k], torch.sigmoid(probe[:, 0]))
        previous = tokens[:, k]
    # the bias matters: without it the block's own argmax gives other drafts
    plain = logits[:, :5].argmax(-1)
    assert (plain + drafter.d2t[plain]).tolist() != tokens.tolist()
    with pytest.raises(UserError, match="draft=chain"):
        drafter.propose_tree(cache, hidden, logits, 3, 2, 6)


def test_confidence_head_is_calibrated(target):
    """Mid-training (slots right about half the time), the confidence head's mean prediction on
    freshly drawn blocks tracks the rate at which slots draft the target's token, and it ranks
    accepted slots above rejected ones. (A tiny random target's text does not generalize across
    sequences, so the blocks are new anchors in the trained sequences.)"""
    train = self_distilled_batch(target, 8, 48, seed=0)
    vocab = vocab_over(target, train["input_ids"].flatten().tolist(), 1024)
    drafter = make_drafter(target, vocab, "dspark", "drafter.markov_rank=32")
    captured = capture(target, vocab, train, drafter.capture_layers())
    train_steps(drafter, train, captured, 35)
    torch.manual_seed(123)
    with torch.no_grad():
        rows = drafter.block_rows(train, captured)
        bias, logit = drafter.markov(rows.hidden, rows.previous)
        accepted = ((drafter.lm_head(rows.hidden) + bias).argmax(-1) == rows.teacher_token).float()
    confidence = torch.sigmoid(logit)
    assert 0.2 < accepted.mean() < 0.9
    assert abs(confidence.mean() - accepted.mean()) < 0.1
    # AUC: a random accepted slot outranks a random rejected one
    auc = (confidence[accepted == 1][:, None] > confidence[accepted == 0][None, :]).float().mean()
    assert auc > 0.65


def test_native_artifact_round_trip(target, data, tmp_path):
    for name, overrides in (("dflash", []), ("dspark", ["drafter.markov_rank=8"])):
        drafter = make_drafter(target, data[2], name, *overrides).eval()
        saved = native_round_trip(drafter, compose_train(VARIED_TARGET).target, target,
                                  chat_ids(target, PROMPTS[0]), tmp_path / name)
        assert saved.hparams["block_size"] == 8 and saved.weights["fc.weight"].shape[1] == 5 * target.spec.hidden_size


def test_bad_settings_are_one_clear_line(target, data):
    with pytest.raises(UserError, match="drafter.block_size=1"):
        make_drafter(target, data[2], "dflash", "drafter.block_size=1")
    with pytest.raises(UserError, match="mask_token_id=99999999"):
        make_drafter(target, data[2], "dflash", "drafter.mask_token_id=99999999")
    with pytest.raises(UserError, match="markov_rank=0"):
        make_drafter(target, data[2], "dspark", "drafter.markov_rank=0")


@pytest.mark.statistical
def test_dspark_sampling_with_confidence_scheduling_keeps_the_target_distribution():
    """DSpark draws slot k from (block logits + the Markov bias of the draft before it), and the
    confidence schedule cuts the chain from confidences that depend only on earlier drafts: the
    first three generated tokens over many runs follow the target's exact joint distribution."""
    cfg = compose_train(["target=tiny_llama", f"target.random_init.vocab_size={TOY_VOCAB}", "target.draft_vocab_size=6",
                         "target.random_init.num_hidden_layers=4", "drafter=dspark", "drafter.num_aux=1", "drafter.markov_rank=4",
                         "drafter.block_size=4"])
    torch.manual_seed(0)
    small = load_target(cfg.target)
    vocab = vocab_over(small, [2, 3, 4, 5, 6, 7] * 10, 6)  # tokens 0 and 1 can never be drafted
    torch.manual_seed(1)
    drafter = build_drafter(cfg.drafter, small, vocab).eval()
    with torch.no_grad():
        drafter.lm_head.weight.normal_(0, 0.3)
        drafter.markov_head.markov_w2.weight.normal_(0, 3.0)
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
        drafter.confidence_head.proj.weight.normal_(0, 1.0)
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    runs, length = 6000, 3
    counts, proposed, accepted = torch.zeros(TOY_VOCAB**length), 0, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(runs):
            tokens, stats = generate_spec(small, drafter, TOY_PROMPT, length, set(), sampler=sampler, steps=3,
                                          min_confidence=0.3)
            counts[encode(tokens)] += 1
            proposed += sum(stats.proposed_by_pos)
            accepted += sum(stats.accepted_by_pos)
    finally:
        torch.set_num_threads(threads)
    assert 0.1 < accepted / proposed < 0.9
    expected = runs * exact_joint(small, sampler, length)
    assert chi2_pvalue(counts, expected) >= CHI2_MIN_PVALUE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_smollm2_serves_losslessly_in_float32(smollm2_fp32_target, name):
    options = [dict(steps=7), dict(steps=7, min_confidence=0.1)]
    assert_lossless_on_smollm2(smollm2_fp32_target, name, *options, *([dict(draft="tree", depth=4, topk=3, total=12)] if name == "dflash" else []))
