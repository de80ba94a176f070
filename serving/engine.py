"""Speculative generation in one short loop (batch size 1, chain drafts, greedy verification).

    prefill -> repeat { drafter proposes K tokens; ONE target forward over [last token, drafts];
                        verify (kernels); commit accepted drafts + the bonus token;
                        crop both KV caches to what was accepted; feed the drafter the new features }

Greedy verification keeps exactly the target's greedy output: a draft is kept only if it is the
target's own argmax after the accepted prefix, and the bonus token is the target's argmax.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kernels import greedy_verify


@dataclass
class Stats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill + verification forwards
    accepted_by_pos: list[int] = field(default_factory=list)  # drafts accepted at position k
    proposed_by_pos: list[int] = field(default_factory=list)  # drafts proposed at position k
    seconds: float = 0.0
    margins: list[float] = field(default_factory=list)  # plain decoding: top-1 minus top-2 logit per token

    @property
    def accept_len(self) -> float:
        """Tokens committed per target forward, bonus included."""
        return self.new_tokens / max(self.target_forwards, 1)

    def count(self, proposed: int, accepted: int) -> None:
        while len(self.proposed_by_pos) < proposed:
            self.proposed_by_pos.append(0)
            self.accepted_by_pos.append(0)
        for k in range(proposed):
            self.proposed_by_pos[k] += 1
            self.accepted_by_pos[k] += int(k < accepted)


def _finish(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) or at max_new_tokens, exactly where plain decoding stops."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.no_grad()
def generate_plain(target, prompt_ids: torch.Tensor, max_new_tokens: int, eos: set[int]):
    """Greedy decoding with the target alone, token by token, on the same forward path."""
    began = time.perf_counter()
    cache = DynamicCache()
    _, final = target.capture(prompt_ids, None, [], cache=cache)
    tokens: list[int] = []
    margins: list[float] = []
    while True:
        top = target.logits(final[:, -1]).float().topk(2, -1)
        token = int(top.indices[0, 0])
        tokens.append(token)
        margins.append(float(top.values[0, 0] - top.values[0, 1]))
        if token in eos or len(tokens) >= max_new_tokens:
            break
        _, final = target.capture(torch.tensor([[token]], device=prompt_ids.device), None, [], cache=cache)
    stats = Stats(new_tokens=len(tokens), target_forwards=len(tokens), seconds=time.perf_counter() - began, margins=margins)
    return tokens, stats


@torch.no_grad()
def generate_chain(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, eos: set[int],
                   steps: int = 7, min_prob: float = 0.0):
    """Speculative greedy decoding with a chain of up to `steps` drafts per target forward.

    `min_prob` > 0 turns on dynamic draft length: the chain stops at the first draft whose
    draft probability falls below it (the drafter's own confidence)."""
    began = time.perf_counter()
    layers = drafter.capture_layers()
    cache, draft_cache = DynamicCache(), drafter.new_cache()
    aux, final = target.capture(prompt_ids, None, layers, cache=cache)
    last = target.logits(final[:, -1]).argmax(-1, keepdim=True)  # the first token, from prefill
    tokens = [int(last)]
    # drafter context: features of positions 0..P-1, each with the token that followed it
    feature, logits = drafter.extend(draft_cache, aux, torch.cat([prompt_ids[:, 1:], last], 1))
    stats = Stats(target_forwards=1)  # the prefill forward gave the first token
    done = tokens[0] in eos or max_new_tokens <= 1
    while not done:
        length = cache.get_seq_length()  # target positions in cache; `last` sits at `length`
        drafts, probs = drafter.propose_chain(draft_cache, feature, logits, steps)
        if min_prob > 0:
            keep = max(int((probs[0] >= min_prob).cumprod(0).sum()), 1)
            drafts = drafts[:, :keep]
        candidates = torch.cat([last, drafts], 1)
        aux, final = target.capture(candidates, None, layers, cache=cache)
        parents = torch.arange(-1, candidates.shape[1] - 1, device=candidates.device)[None]
        _, accepted, bonus = greedy_verify(target.logits(final), candidates, parents)
        accepted = int(accepted)
        new = drafts[0, :accepted].tolist() + [int(bonus)]
        stats.target_forwards += 1
        stats.count(drafts.shape[1], accepted)
        # keep target entries of [last, accepted drafts]; drafter entries of context only
        rejected = cache.get_seq_length() - (length + accepted + 1)
        if rejected:
            cache.crop(-rejected)  # transformers 5: a negative count of tokens to drop
        draft_cache.crop(length)
        last = bonus.view(1, 1)
        feature, logits = drafter.extend(
            draft_cache, [a[:, : accepted + 1] for a in aux], torch.tensor([new], device=candidates.device)
        )
        tokens.extend(new)
        tokens, done = _finish(tokens, eos, max_new_tokens)
    stats.new_tokens = len(tokens)
    stats.seconds = time.perf_counter() - began
    return tokens, stats
