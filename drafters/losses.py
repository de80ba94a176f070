"""Distillation pieces shared by drafter losses: which positions are trained on, and the soft
cross-entropy against the target's next-token distribution with its top-1 agreement."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafters.base import Captured


def trained_positions(batch: dict, captured: Captured) -> torch.Tensor:
    """[B, T] bool: the teacher at t (the target's distribution of token t+1) is learned from: token
    t+1 is an assistant token and the target's greedy token is in the draft vocabulary."""
    return F.pad(batch["loss_mask"][:, 1:], (0, 1)).bool() & captured.in_vocab


def distill(logits: torch.Tensor, teacher: torch.Tensor, teacher_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of draft `logits` [N, V_draft] against the `teacher` distribution [N, V_draft],
    averaged over the N rows, and the fraction of rows whose top-1 is the target's greedy token (a
    detached 0-dim tensor, as every metric is: reading it would make the GPU wait)."""
    count = max(len(logits), 1)
    logits = logits.float()
    loss = F.cross_entropy(logits, teacher, reduction="sum") / count
    return loss, (logits.argmax(-1) == teacher_token).sum().detach() / count


def normalized_decay(decay: float, steps: int) -> list[float]:
    """Step weights decay^(k-1) for k = 1..steps, normalized to sum to 1 (FastMTP's 0.6^(k-1))."""
    weights = [decay**k for k in range(steps)]
    return [weight / sum(weights) for weight in weights]


def unrolled_distill(batch: dict, captured: Captured, feature: torch.Tensor, weights: list[float], step, head):
    """Training-time test over len(weights) chained draft steps, each distilled from the target.

    Step k (0-based) runs over the whole sequence at once: row t takes token t+1+k and the feature
    the previous step left at t (step 0: `feature`, from the target), `step(k, tokens, feature) ->
    feature`, and `head(feature rows) -> draft logits` learns the target's distribution of token
    t+2+k. Returns (sum_k weights[k] x loss_k, metrics acc/k and loss/k for k = 1..K)."""
    length = batch["input_ids"].shape[1]
    predicts = trained_positions(batch, captured)
    teacher = torch.softmax(captured.teacher_logits.float(), -1)
    total, metrics = 0.0, {}
    for k, weight in enumerate(weights):
        shift = k + 1
        feature = step(k, F.pad(batch["input_ids"][:, shift:], (0, shift)), feature)
        rows = predicts[:, shift:]  # the vocabulary-wide work (head, softmax) only on rows with a target
        step_loss, metrics[f"acc/{shift}"] = distill(head(feature[:, : length - shift][rows]), teacher[:, shift:][rows],
                                                     captured.teacher_token[:, shift:][rows])
        total = total + weight * step_loss
        metrics[f"loss/{shift}"] = step_loss.detach()
    return total, metrics
