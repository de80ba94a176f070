"""Distillation pieces shared by drafter losses: which positions are trained on, and the divergence
(`drafter.loss`) from the target's next-token distribution with its top-1 agreement."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafters.base import Captured


def trained_positions(batch: dict, captured: Captured) -> torch.Tensor:
    """[B, T] bool: the teacher at t (the target's distribution of token t+1) is learned from: token
    t+1 is an assistant token and the target's greedy token is in the draft vocabulary."""
    return F.pad(batch["loss_mask"][:, 1:], (0, 1)).bool() & captured.in_vocab


def divergence(logits: torch.Tensor, teacher: torch.Tensor, kind: str = "soft_ce", reduction: str = "none") -> torch.Tensor:
    """Per row [N] (`reduction="sum"`: summed), how far the draft `logits` [N, V_draft] are from the
    `teacher` distribution p: soft cross-entropy H(p, q) (forward KL plus p's entropy: the same
    gradient), reverse KL(q || p) (mode-seeking: q's mass where p has it), or total variation
    |p - q|_1 / 2 (1 - TV is the chance a sampled draft is accepted)."""
    logits = logits.float()
    if kind == "soft_ce":
        return F.cross_entropy(logits, teacher, reduction=reduction)
    if kind == "tv":
        rows = 0.5 * (torch.softmax(logits, -1) - teacher).abs().sum(-1)
    else:
        log_q = torch.log_softmax(logits, -1)
        rows = (log_q.exp() * (log_q - teacher.clamp_min(1e-30).log())).sum(-1)
    return rows.sum() if reduction == "sum" else rows


def distill(logits: torch.Tensor, teacher: torch.Tensor, teacher_token: torch.Tensor,
            kind: str = "soft_ce") -> tuple[torch.Tensor, torch.Tensor]:
    """The `divergence` of draft `logits` [N, V_draft] from the `teacher` distribution [N, V_draft],
    averaged over the N rows, and the fraction of rows whose top-1 is the target's greedy token (a
    detached 0-dim tensor, as every metric is: reading it would make the GPU wait)."""
    count = max(len(logits), 1)
    loss = divergence(logits, teacher, kind, reduction="sum") / count
    return loss, (logits.argmax(-1) == teacher_token).sum().detach() / count


def shifted_teacher(captured: Captured, predicts: torch.Tensor):
    """`teacher(shift)`: the target's distribution [N, V_draft] at the positions `predicts[:, shift:]`
    selects, the rows a draft `shift` tokens ahead learns from. The softmax runs once, on the trained
    positions only (over the whole padded batch it costs several times as much)."""
    probabilities = torch.softmax(captured.teacher_logits[predicts].float(), -1)
    slot = predicts.flatten().cumsum(0).view_as(predicts) - 1  # each trained position's row in `probabilities`
    return lambda shift: probabilities[slot[:, shift:][predicts[:, shift:]]]


def normalized_decay(decay: float, steps: int) -> list[float]:
    """Step weights decay^(k-1) for k = 1..steps, normalized to sum to 1 (FastMTP's 0.6^(k-1))."""
    weights = [decay**k for k in range(steps)]
    return [weight / sum(weights) for weight in weights]


def curriculum(steps: int, start: int | None, progress: float) -> int:
    """The TTT unroll at `progress` (0..1) of a run: `start` steps at first, one more at each equal
    share of the run, `steps` at the end (`start` None: `steps` throughout)."""
    if start is None or start >= steps:
        return steps
    return min(steps, start + int((steps - start + 1) * progress))


def unrolled_distill(batch: dict, captured: Captured, feature: torch.Tensor, weights: list[float], step, head,
                     kind: str = "soft_ce"):
    """Training-time test over len(weights) chained draft steps, each distilled from the target.

    Step k (0-based) runs over the whole sequence at once: row t takes token t+1+k and the feature
    the previous step left at t (step 0: `feature`, from the target), `step(k, tokens, feature) ->
    feature`, and `head(feature rows) -> draft logits` learns the target's distribution of token
    t+2+k, by the divergence `kind`. Returns (sum_k weights[k] x loss_k, metrics acc/k and loss/k for
    k = 1..K)."""
    length = batch["input_ids"].shape[1]
    predicts = trained_positions(batch, captured)
    teacher = shifted_teacher(captured, predicts)
    total, metrics = 0.0, {}
    for k, weight in enumerate(weights):
        shift = k + 1
        feature = step(k, F.pad(batch["input_ids"][:, shift:], (0, shift)), feature)
        rows = predicts[:, shift:]  # the vocabulary-wide work (head, softmax) only on rows with a target
        step_loss, metrics[f"acc/{shift}"] = distill(head(feature[:, : length - shift][rows]), teacher(shift),
                                                     captured.teacher_token[:, shift:][rows], kind)
        total = total + weight * step_loss
        metrics[f"loss/{shift}"] = step_loss.detach()
    return total, metrics
