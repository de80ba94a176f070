"""The serving side of drafters, in two shapes the engine drives the same way:

- `StepDrafter`: one token per drafter forward, its own feature fed back (EAGLE-3, EAGLE-1, MTP):
  context extension, chain and EAGLE-2 tree proposal over a DraftCache. A subclass provides
  `fuse(aux)` (target features -> its input feature),
  `step(cache, tokens, feature, positions, mask) -> feature` and `draft_logits(feature)`, apart so
  that a context extension computes logits for its last entry only.
- `ParallelDrafter`: every position ahead from one forward (Medusa's heads, DFlash's block):
  `extend` returns logits [B, K, V_draft] for the K tokens after the bonus token, and chains and
  trees are built from those fixed per-position distributions.

Both implement the serving half of the `Drafter` interface (drafters/base.py). A draft's
confidence is by default its top probability; confidence-scheduled verification cuts the chain
where their running product falls below a threshold. Draft ids map to target ids through `d2t`.
"""

from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F

from drafters.base import Drafter, greedy_draw
from drafters.layers import DraftCache
from kernels import tree_ancestors


class StepDrafter(Drafter):
    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def step(self, cache: DraftCache, tokens, feature, positions, mask=None) -> torch.Tensor:
        """One forward over `tokens` [B, T] with input `feature` [B, T, H] at `positions`, appending
        to `cache` (causal, or `mask` [T, cache + T] for tree nodes); returns its features [B, T, H]."""
        raise NotImplementedError

    def draft_logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_draft] from the features `step` returned."""
        raise NotImplementedError

    def new_cache(self, target_cache=None) -> DraftCache:
        return DraftCache()

    @staticmethod
    def positions(start: int, tokens: torch.Tensor) -> torch.Tensor:
        return torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)

    @torch.no_grad()
    def extend(self, cache: DraftCache, aux: list[torch.Tensor], next_tokens: torch.Tensor):
        """Add context entries for target positions cache.length.. : the fused target features at t
        with the token committed at t+1. Returns the last entry's (feature, draft logits)."""
        feature = self.step(cache, next_tokens, self.fuse(aux), self.positions(cache.length, next_tokens))[:, -1:]
        return feature, self.draft_logits(feature)

    @torch.no_grad()
    def propose_chain(self, cache: DraftCache, feature, logits, steps: int, draw=None, stop=None):
        """A chain of up to `steps` drafts (target ids) from the last context entry, feeding the
        drafter's own feature back (what TTT trained for). `draw(logits) -> (draft ids,
        distribution)` picks each draft (default: greedy); `stop(confidences so far) -> bool`, asked
        after each draft (batch 1), ends the chain early. Also returns the distributions
        [B, drafts, V_draft] they came from and the confidences [B, drafts] (each distribution's top
        probability)."""
        draw = draw or greedy_draw
        tokens, dists, confidences = [], [], []
        for i in range(steps):
            draft, dist = draw(logits[:, -1])
            token = draft + self.d2t[draft]
            tokens.append(token)
            dists.append(dist)
            if stop:
                confidences.append(float(dist.amax()))
            if i + 1 == steps or (stop and stop(confidences)):
                break
            feature = self.step(cache, token[:, None], feature, self.positions(cache.length, token[:, None]))
            logits = self.draft_logits(feature)
        dists = torch.stack(dists, 1)
        return torch.stack(tokens, 1), dists, dists.amax(-1)

    @torch.no_grad()
    def propose_tree(self, cache: DraftCache, feature, logits, depth: int, topk: int, total: int, draw=None):
        """EAGLE-2 dynamic tree from the last context entry: at each depth expand the `topk` best
        nodes by cumulative draft log-probability (one drafter forward for all of them), keep the
        `topk` best children overall, and finally the `total` best nodes.

        With `draw` (sampling) each expanded node gets `topk` i.i.d. children drawn from its draft
        distribution and keeps all of them, and the tree keeps its first `total` nodes in creation
        order: rejection sampling over a node's children is exact only for such draws.

        Returns (tokens [total] target ids, parents [total], dists) in topological order, parents
        indexing 1..total with 0 = the root (the last committed token); dists [1 + total, V_draft]
        holds the distribution each node's children were drawn from (None without `draw`)."""
        context, device = cache.length, logits.device

        def children(step_logits):  # [F, V_draft] -> (log-probs [F, topk], draft ids [F, topk], dists)
            if draw is None:
                return *torch.log_softmax(step_logits.float(), -1).topk(topk), None
            drafts, dists = draw(step_logits[:, None].expand(-1, topk, -1))
            return dists.gather(-1, drafts[..., None]).squeeze(-1).log(), drafts, dists[:, 0]

        scores, drafts, dists = children(logits[0, -1:])
        node_tokens, node_scores = [drafts[0]], [scores[0]]
        node_dists = {0: dists[0]} if draw else {}
        parent_of = [-1] + [0] * topk  # node 0 is the root
        frontier = list(range(1, topk + 1))
        frontier_features = feature.expand(1, topk, -1)
        cached: list[int] = []  # tree nodes with an entry in the drafter cache, in cache order
        for level in range(1, depth):
            # each frontier node sees the context, its cached ancestors and itself
            sees = tree_ancestors(torch.tensor(parent_of, device=device)[None])[0]  # [node, node]: itself or an ancestor
            mask = torch.cat([torch.ones(len(frontier), context, dtype=torch.bool, device=device),
                              sees[torch.tensor(frontier, device=device)][:, torch.tensor(cached + frontier, device=device)]], 1)
            tokens = torch.cat(node_tokens)[torch.tensor(frontier, device=device) - 1]
            positions = torch.full((1, len(frontier)), context + level - 1, device=device)
            features = self.step(cache, (tokens + self.d2t[tokens])[None], frontier_features, positions, mask)
            step_logits = self.draft_logits(features)
            cached += frontier
            child_scores, child_drafts, dists = children(step_logits[0])
            if draw:
                node_dists.update(zip(frontier, dists))
            parent_scores = torch.cat(node_scores)[torch.tensor(frontier, device=device) - 1]
            scores = (parent_scores[:, None] + child_scores).flatten()
            best = scores.topk(topk).indices
            new = torch.arange(len(scores), device=device) if draw else best  # sampling keeps every draw
            first_new = len(parent_of)
            node_tokens.append(child_drafts.flatten()[new])
            node_scores.append(scores[new])
            parent_of += torch.tensor(frontier, device=device)[new // topk].tolist()
            # the next frontier: the best children, by their index among the new nodes
            frontier = (first_new + (best if draw else torch.arange(topk, device=device))).tolist()
            frontier_features = features[:, best // topk]
        scores = torch.cat(node_scores)
        if draw:
            keep = torch.arange(1, min(total, len(scores)) + 1, device=device)
        else:
            # stable sort: on equal scores a parent (lower index) ranks before its child, so the
            # kept set is closed under ancestors
            keep = torch.sort(torch.sort(scores, descending=True, stable=True).indices[:total]).values + 1
        renumber = torch.zeros(len(parent_of), dtype=torch.long, device=device)
        renumber[keep] = torch.arange(1, len(keep) + 1, device=device)
        drafts = torch.cat(node_tokens)[keep - 1]
        parents = renumber[torch.tensor(parent_of, device=device)[keep]]
        out_dists = None
        if draw:
            out_dists = torch.zeros(len(keep) + 1, logits.shape[-1], device=device)
            for node, dist in node_dists.items():
                if node == 0 or renumber[node] > 0:
                    out_dists[renumber[node]] = dist
        return drafts + self.d2t[drafts], parents, out_dists


class ParallelDrafter(Drafter):
    """A drafter whose `extend` gives logits [B, K, V_draft] for all K positions after the bonus
    token at once (Medusa heads, a DFlash block): a chain takes each position's token, a tree is
    the Cartesian tree of their top-k tokens."""

    @torch.no_grad()
    def propose_chain(self, cache: DraftCache, feature, logits, steps: int, draw=None, stop=None):
        """Position k's token as draft k, for the first min(steps, K) positions (target ids [B, k]),
        with the distributions they were drawn from [B, k, V_draft] and their top probabilities as
        confidences. Every position draws on its own, which is what rejection sampling needs: each
        draft comes from a distribution fixed before it. One forward made them all: `stop` is
        not asked (the caller cuts the chain by the confidences)."""
        drafts, dists = (draw or greedy_draw)(logits[:, :steps])
        return drafts + self.d2t[drafts], dists, dists.amax(-1)

    @torch.no_grad()
    def propose_tree(self, cache: DraftCache, feature, logits, depth: int, topk: int, total: int, draw=None):
        """Medusa's tree over the first `depth` positions: level l holds guesses for position l+1,
        below every node of level l-1; the `total` best nodes by the product of their path's
        probabilities, each position offering its `topk` best tokens.

        With `draw` (sampling) the tree has the same shape (decided by the probabilities, never by
        the draws), but a node's children are i.i.d. draws from the next position's
        distribution (rejection sampling over siblings is exact only for such draws), and dists
        [1 + n, V_draft] holds that distribution for every node (zeros for the deepest level, which
        has no children). Returns (tokens [n] target ids, parents [n] with 0 = the root, dists or None)."""
        heads = logits[0, :depth].float()
        log_probs, top = torch.log_softmax(heads, -1).topk(min(topk, heads.shape[-1]))
        nodes = best_nodes(log_probs.tolist(), total)
        parents, levels, ranks = (torch.tensor(column, device=logits.device) for column in zip(*nodes))
        if draw is None:
            drafts = top[levels, ranks]
            return drafts + self.d2t[drafts], parents, None
        drafts, level_dists = torch.empty_like(levels), []
        for level in range(int(levels.max()) + 1):
            here = levels == level
            drafts[here], dist = draw(heads[level].expand(int(here.sum()), -1))
            level_dists.append(dist[0])
        # the root's children come from position 1, the children of a level-l node from position l+2
        below = torch.stack([*level_dists, torch.zeros_like(level_dists[0])])
        return drafts + self.d2t[drafts], parents, below[F.pad(levels + 1, (1, 0))]


def best_nodes(log_probs: list[list[float]], total: int) -> list[tuple[int, int, int]]:
    """The `total` most likely nodes of the Cartesian tree whose level-l nodes take head l's tokens
    (`log_probs[l]`, best first), a node scoring the sum over its path. Best-first: a node's first
    child and its next sibling join the queue when it leaves it, so nodes leave by descending score,
    each after its parent. Returns (parent, level, rank) per node; nodes count from 1, 0 = the root."""

    def score(path):
        return sum(log_probs[level][rank] for level, rank in enumerate(path))

    queue = [(-score((0,)), (0,), 0)]
    nodes: list[tuple[int, int, int]] = []
    while queue and len(nodes) < total:
        _, path, parent = heapq.heappop(queue)
        level, rank = len(path) - 1, path[-1]
        nodes.append((parent, level, rank))
        if rank + 1 < len(log_probs[level]):
            sibling = path[:-1] + (rank + 1,)
            heapq.heappush(queue, (-score(sibling), sibling, parent))
        if level + 1 < len(log_probs):
            child = path + (0,)
            heapq.heappush(queue, (-score(child), child, len(nodes)))
    return nodes
