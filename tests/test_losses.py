"""`drafter.loss` (soft_ce | reverse_kl | tv) and EAGLE-3's `freeze_head`: what each computes, and
that every family learns its target's tokens under each divergence."""

import pytest
import torch

from conftest import FAMILIES, compose_train, distilled_setup, random_drafter, trained_on
from drafters.base import Captured, build_drafter, capture
from drafters.losses import curriculum, divergence, shifted_teacher


def test_each_divergence_is_its_formula():
    torch.manual_seed(0)
    logits, teacher = torch.randn(5, 32), torch.softmax(torch.randn(5, 32), -1)
    q = torch.softmax(logits, -1)
    assert torch.allclose(divergence(logits, teacher), -(teacher * q.log()).sum(-1), atol=1e-5)
    assert torch.allclose(divergence(logits, teacher, "reverse_kl"), (q * (q / teacher).log()).sum(-1), atol=1e-5)
    assert torch.allclose(divergence(logits, teacher, "tv"), 1 - torch.minimum(q, teacher).sum(-1), atol=1e-5)
    # a draft that is the teacher: no distance left, and soft CE falls to the teacher's entropy
    assert divergence(teacher.log(), teacher, "reverse_kl").abs().max() < 1e-5
    assert divergence(teacher.log(), teacher, "tv").abs().max() < 1e-6
    assert torch.allclose(divergence(teacher.log(), teacher), -(teacher * teacher.log()).sum(-1), atol=1e-5)


def test_the_teacher_of_each_shifted_step_is_the_softmax_of_the_whole_batch_at_its_rows():
    """Computed on the trained positions alone, bit for bit what softmax over the padded batch gives."""
    torch.manual_seed(0)
    logits, predicts = torch.randn(3, 37, 500).bfloat16(), torch.rand(3, 37) < 0.5
    predicts[1] = False  # a row with nothing to learn
    teacher = shifted_teacher(Captured(aux=[], final=None, teacher_logits=logits, in_vocab=None, teacher_token=None),
                              predicts)
    whole = torch.softmax(logits.float(), -1)
    for shift in range(5):
        rows = predicts[:, shift:]
        assert teacher(shift).shape == (int(rows.sum()), 500)
        assert torch.equal(teacher(shift), whole[:, shift:][rows])


@pytest.fixture(scope="module")
def setup(tiny_target):
    return distilled_setup(tiny_target)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("kind", ["reverse_kl", "tv"])
def test_every_family_learns_its_target_under_each_divergence(setup, name, kind):
    target, _, vocab = setup
    drafter = random_drafter(name, target, vocab)
    drafter.cfg.loss = kind
    _, history = trained_on(drafter.train(), setup, steps=30)
    # top-1 agreement with the target on most positions; each starts below 0.1 but Medusa, whose
    # first head starts as the target's own lm_head (DSpark's loss also weighs its confidence head)
    assert history[-1][1] >= 0.7, history


def test_a_frozen_head_is_left_as_it_started(setup):
    target, _, vocab = setup
    torch.manual_seed(0)
    drafter = build_drafter(compose_train(["target=tiny_llama", "drafter.freeze_head=true"]).drafter, target, vocab)
    head, fc = drafter.lm_head.weight.clone(), drafter.fc.weight.clone()
    assert torch.equal(head, target.lm_head_weight[vocab.draft_ids].float())  # started from the target's rows
    _, history = trained_on(drafter.train(), setup, steps=10)
    assert torch.equal(drafter.lm_head.weight, head) and not drafter.lm_head.weight.requires_grad
    assert not torch.equal(drafter.fc.weight, fc) and history[-1][0] < history[0][0]


def test_a_ttt_curriculum_unrolls_more_steps_as_the_run_goes_on(setup):
    assert [curriculum(5, 2, p) for p in (0, 0.24, 0.25, 0.5, 0.99, 1)] == [2, 2, 3, 4, 5, 5]
    assert curriculum(5, None, 0) == curriculum(5, 7, 0) == 5
    target, batch, vocab = setup
    drafter = build_drafter(compose_train(["target=tiny_llama", "drafter.ttt_steps=5", "drafter.ttt_start=2"]).drafter,
                            target, vocab)
    captured = capture(target, vocab, batch, drafter.capture_layers())
    for progress, unroll in ((0.0, 2), (0.5, 4), (1.0, 5)):
        drafter.progress = progress
        _, metrics = drafter.loss(batch, captured)
        assert sorted(key for key in metrics if key.startswith("acc/")) == [f"acc/{k}" for k in range(1, unroll + 1)]
