"""DSpark: the DFlash block drafter plus a Markov head and a confidence head.

- Markov head: a low-rank bias on slot k's logits from the token right before it (the previous
  draft; the last committed token for slot 1): `markov_w2(markov_w1[previous])`, rank r. The block
  forward stays one pass; drafting a chain walks the slots, adding each bias after drawing the
  token before it (a vector lookup, no transformer work).
- Confidence head: a linear probe on [slot hidden state ; the Markov embedding of the previous
  token] -> the probability that the slot's draft is accepted (greedy: it is the target's token),
  trained with BCE. The engine's confidence-scheduled verification multiplies them along the chain.

Loss, each term slot-decayed like DFlash's: 0.1 x `drafter.loss` (soft cross-entropy) + 0.9 x total variation (against
the target's distribution) + 1.0 x BCE. Training feeds the Markov head the data's own previous
token (teacher forcing), serving the drawn draft.

Weight names follow speculators' DSpark (`markov_head.markov_w1`, `markov_head.markov_w2`,
`confidence_head.proj`), on top of DFlash's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import Captured, greedy_draw, register
from drafters.config.errors import UserError
from drafters.config.settings import at_least
from drafters.dflash import ContextCache, DFlash
from drafters.losses import divergence


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # starts as a near-zero bias
        self.markov_w2 = nn.Linear(rank, draft_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


@register("dspark")
class DSpark(DFlash):
    @dataclass
    class Settings(DFlash.Settings):
        markov_rank: int = at_least(1)  # drafter=dflash is DSpark without the Markov head
        ce_weight: float = at_least(0)
        tv_weight: float = at_least(0)
        confidence_weight: float = at_least(0)

    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        rank = int(cfg.markov_rank)
        self.markov_head = MarkovHead(spec.vocab_size, vocab.draft_size, rank)
        self.confidence_head = ConfidenceHead(spec.hidden_size + rank)

    def markov(self, hidden: torch.Tensor, previous: torch.Tensor):
        """(logit bias [..., V_draft], confidence logit [...]) of slots with hidden states `hidden`
        [..., H] whose previous token is `previous` [...] (target ids)."""
        embedding = self.markov_head.markov_w1(previous).to(hidden.dtype)
        confidence = self.confidence_head.proj(torch.cat([hidden, embedding], -1)).squeeze(-1)
        return self.markov_head.markov_w2(embedding), confidence

    def loss(self, batch: dict, captured: Captured):
        rows = self.block_rows(batch, captured)
        bias, confidence = self.markov(rows.hidden, rows.previous)
        logits = (self.lm_head(rows.hidden) + bias).float()
        cross_entropy = divergence(logits, rows.teacher, self.cfg.get("loss", "soft_ce"))
        variation = divergence(logits, rows.teacher, "tv")
        # a greedy verifier accepts the slot's draft iff it is the target's token
        accepted = (logits.argmax(-1) == rows.teacher_token).float()
        bce = F.binary_cross_entropy_with_logits(confidence.float(), accepted, reduction="none")
        total = (float(self.cfg.ce_weight) * self.decayed(cross_entropy, rows.slot)
                 + float(self.cfg.tv_weight) * self.decayed(variation, rows.slot)
                 + float(self.cfg.confidence_weight) * self.decayed(bce, rows.slot))
        metrics = self.slot_metrics(logits, rows, loss=cross_entropy, tv=variation, bce=bce,
                                    confidence=torch.sigmoid(confidence.float()))
        return total, metrics

    # ---- serving: the slots' base logits come from one block forward; the chain adds each slot's
    # Markov bias once the token before it is drawn

    @torch.no_grad()
    def propose_chain(self, cache: ContextCache, feature, logits, steps: int, draw=None, stop=None):
        """Slot k's draft from its logits plus the Markov bias of the draft before it (slot 1: the last
        committed token), with the distribution it was drawn from and the confidence head's estimate
        (one block forward made the slots: `stop` is not asked, as in ParallelDrafter)."""
        draw = draw or greedy_draw
        previous = cache.last_token[:, 0]
        tokens, dists, confidences = [], [], []
        for k in range(min(steps, logits.shape[1])):
            bias, confidence = self.markov(feature[:, k], previous)
            draft, dist = draw(logits[:, k] + bias)
            previous = draft + self.d2t[draft]
            tokens.append(previous)
            dists.append(dist)
            confidences.append(torch.sigmoid(confidence.float()))
        return torch.stack(tokens, 1), torch.stack(dists, 1), torch.stack(confidences, 1)

    def propose_tree(self, cache, feature, logits, depth, topk, total, draw=None):
        raise UserError("drafter dspark drafts chains (its Markov head conditions every slot on the draft "
                        "before it): use draft=chain")
