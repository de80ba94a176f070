"""Speculative generation in one short loop (batch size 1, chain or tree drafts, greedy verification).

    prefill -> repeat { drafter proposes a chain or a tree; ONE target forward over [last token, drafts]
                        under a tree attention mask;
                        verify (kernels); commit accepted drafts + the bonus token;
                        compact + crop both KV caches to the accepted path; feed the drafter the new features }

Greedy verification keeps exactly the target's greedy output: a draft is kept only if it is the
target's own argmax after the accepted prefix, and the bonus token is the target's argmax.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kernels import compact_kv_caches, greedy_verify, tree_ancestors


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
def generate_spec(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, eos: set[int], *,
                  draft: str = "chain", steps: int = 7, min_prob: float = 0.0, depth: int = 6, topk: int = 8,
                  total: int = 48):
    """Speculative greedy decoding.

    draft="chain": up to `steps` drafts per target forward; `min_prob` > 0 turns on dynamic draft
    length (the chain stops at the first draft whose draft probability falls below it).
    draft="tree": an EAGLE-2 dynamic tree (`depth` levels, `topk` expansions per level, the
    `total` best nodes verified at once under a tree attention mask)."""
    began = time.perf_counter()
    layers = drafter.capture_layers()
    cache, draft_cache = DynamicCache(), drafter.new_cache()
    aux, final = target.capture(prompt_ids, None, layers, cache=cache)
    last = target.logits(final[:, -1]).argmax(-1, keepdim=True)  # the first token, from prefill
    tokens = [int(last)]
    # drafter context: features of positions 0..P-1, each with the token that followed it
    feature, logits = drafter.extend(draft_cache, aux, torch.cat([prompt_ids[:, 1:], last], 1))
    stats = Stats(target_forwards=1)  # the prefill forward gave the first token
    device = prompt_ids.device
    done = tokens[0] in eos or max_new_tokens <= 1
    while not done:
        length = cache.get_seq_length()  # target positions in cache; `last` sits at `length`
        if draft == "tree":
            drafts, parents = drafter.propose_tree(draft_cache, feature, logits, depth, topk, total)
        else:
            drafts, probs = drafter.propose_chain(draft_cache, feature, logits, steps)
            keep = max(int((probs[0] >= min_prob).cumprod(0).sum()), 1) if min_prob > 0 else steps
            drafts, parents = drafts[0, :keep], torch.arange(keep, device=device)
        draft_cache.crop(length)  # drop the drafter's speculative entries
        candidates = torch.cat([last, drafts[None]], 1)
        parents = torch.cat([torch.tensor([-1], device=device), parents])[None]
        visible = tree_ancestors(parents)  # a node sees its ancestors (a chain: causal)
        mask = torch.cat([torch.ones(1, candidates.shape[1], length, dtype=torch.bool, device=device), visible], -1)
        aux, final = target.capture(candidates, mask[:, None], layers, cache=cache,
                                    position_ids=length + visible.sum(-1) - 1)
        path, accepted, bonus = greedy_verify(target.logits(final), candidates, parents)
        accepted = int(accepted)
        nodes = path[0, : accepted + 1]
        stats.target_forwards += 1
        stats.count(int(visible.sum(-1).max()) - 1, accepted)
        # the accepted path's target entries move to contiguous positions; the rest is dropped
        if draft == "tree":
            compact_kv_caches([(layer.keys, layer.values) for layer in cache.layers], (length + nodes)[None],
                              torch.tensor([length], device=device), torch.tensor([accepted + 1], device=device))
        rejected = cache.get_seq_length() - (length + accepted + 1)
        if rejected:
            cache.crop(-rejected)  # transformers 5: a negative count of tokens to drop
        new = candidates[0, nodes[1:]].tolist() + [int(bonus)]
        last = bonus.view(1, 1)
        feature, logits = drafter.extend(draft_cache, [a[:, nodes] for a in aux], torch.tensor([new], device=device))
        tokens.extend(new)
        tokens, done = _finish(tokens, eos, max_new_tokens)
    stats.new_tokens = len(tokens)
    stats.seconds = time.perf_counter() - began
    return tokens, stats
