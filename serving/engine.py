"""Speculative generation in one short loop (batch size 1, chain or tree drafts).

    prefill -> repeat { drafter proposes a chain or a tree; ONE target forward over [last token, drafts]
                        under a tree attention mask;
                        verify (kernels); commit accepted drafts + the bonus token;
                        compact + crop both KV caches to the accepted path; feed the drafter the new features }

Greedy verification (temperature 0) keeps exactly the target's greedy output: a draft is kept only
if it is the target's own argmax after the accepted prefix, and the bonus token is the target's
argmax. Sampling (temperature > 0, top-p) keeps the target's distribution: draft x drawn from q is
accepted with probability min(1, p(x)/q(x)), else the token is drawn from normalize(max(0, p - q)).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from drafters.base import greedy_draw
from drafters.proposal import StepDrafter
from kernels import compact_kv_caches, greedy_verify, rejection_verify, tree_ancestors
from serving.ngram import NgramDrafts, merge
from serving.schedule import AutoSchedule


@dataclass
class Sampler:
    """How the next token is chosen from logits: greedy (temperature 0) or temperature + top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from: softmax(logits / T), cut to the top-p nucleus."""
        probs = torch.softmax(logits.float() / self.temperature, -1)
        if self.top_p < 1:
            ranked, order = probs.sort(-1, descending=True)
            # keep the smallest prefix of the ranking whose mass reaches top_p (always the top token)
            ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked >= self.top_p, 0)
            probs = torch.zeros_like(probs).scatter_(-1, order, ranked)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def draw(self, logits: torch.Tensor):
        """(token ids [...], the distribution they were drawn from); greedy: argmax, softmax."""
        if self.greedy:
            return greedy_draw(logits)
        dist = self.probs(logits)
        flat = dist.reshape(-1, dist.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).view(dist.shape[:-1]), dist

    def uniforms(self, *shape: int, device=None) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, device=device)


GREEDY = Sampler()


@dataclass
class Stats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill + verification forwards
    accepted_by_pos: list[int] = field(default_factory=list)  # drafts accepted at position k
    proposed_by_pos: list[int] = field(default_factory=list)  # drafts proposed at position k
    seconds: float = 0.0
    margins: list[float] = field(default_factory=list)  # plain decoding: top-1 minus top-2 logit per token
    # where a speculative loop's time goes, summed over its iterations (prefill excluded)
    drafting_s: float = 0.0  # the head's context extension and draft steps, n-gram lookups
    head_extend_s: float = 0.0  # of drafting_s: the head's context extensions, lazy (when it drafts next)
    head_extensions: int = 0
    head_extended: int = 0  # context entries they added
    head_step_s: float = 0.0  # of drafting_s: the head's drafter forwards after its extension
    head_steps: int = 0  # those forwards (a chain's drafts after its first, a tree's levels after its first)
    verify_forward_s: float = 0.0  # the target's verification forwards (lm_head included)
    bookkeeping_s: float = 0.0  # tree mask, verify kernel, cache compaction, committing tokens
    head_drafts: int = 0  # drafts of the head verified
    head_drafted: int = 0  # drafts the head computed (a confidence cut drops some before verification)

    @property
    def accept_len(self) -> float:
        """Tokens committed per target forward, bonus included."""
        return self.new_tokens / max(self.target_forwards, 1)

    def add(self, other: "Stats") -> None:
        """Sum another run's counts and times into these (per-position counts position by position)."""
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if name.endswith("_by_pos"):
                mine.extend([0] * (len(value) - len(mine)))
                for k, count in enumerate(value):
                    mine[k] += count
            else:
                setattr(self, name, mine + value)  # margins: one after the other

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


def compare(plain: list[int], spec: list[int], margins: list[float], exact: bool, tolerance: float):
    """('identical' | 'near_tie' (a bf16 rounding flip at a top-2 tie) | 'unexplained', the plain
    run's top-2 logit gap where the outputs first differ, or None)."""
    if plain == spec:
        return "identical", None
    first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    margin = margins[first] if first < len(margins) else None
    if not exact and margin is not None and margin <= tolerance:
        return "near_tie", margin
    return "unexplained", margin


@torch.no_grad()
def generate_plain(target, prompt_ids: torch.Tensor, max_new_tokens: int, eos: set[int], sampler: Sampler = GREEDY):
    """Decoding with the target alone, token by token, on the same forward path."""
    began = time.perf_counter()
    cache = DynamicCache()
    _, final = target.capture(prompt_ids, None, [], cache=cache)
    tokens: list[int] = []
    margins: list[float] = []
    while True:
        logits = target.logits(final[:, -1])
        token = int(sampler.draw(logits)[0])
        tokens.append(token)
        top = logits.float().topk(2, -1).values
        margins.append(float(top[0, 0] - top[0, 1]))
        if token in eos or len(tokens) >= max_new_tokens:
            break
        _, final = target.capture(torch.tensor([[token]], device=prompt_ids.device), None, [], cache=cache)
    stats = Stats(new_tokens=len(tokens), target_forwards=len(tokens), seconds=time.perf_counter() - began, margins=margins)
    return tokens, stats


def scheduled_length(confidence: torch.Tensor, min_confidence: float = 0.0) -> int:
    """How many of a chain's drafts to verify, from their confidences [K] (each the drafter's estimate
    that the draft is accepted once the ones before it are): all of them; with `min_confidence`, the
    prefix whose running product stays at or above it (at least one)."""
    survive = confidence.float().cumprod(0)  # the estimated chance that drafts 1..i all survive
    if min_confidence > 0:
        return max(int((survive >= min_confidence).sum()), 1)
    return len(survive)


@torch.no_grad()
def measure_verify_cost(target, layers: list[int], most: int, context: int = 128, repeats: int = 5) -> list[float]:
    """Seconds of one verification forward over n = 1..`most` tokens after `context` cached ones
    (index n; index 0 is 0): what `schedule=auto` starts its cost model from (serving/schedule.py),
    measured once at start-up, interleaved across n, median of `repeats`."""
    cache = DynamicCache()
    target.capture(torch.ones(1, context, dtype=torch.long, device=target.device), None, layers, cache=cache)
    times: list[list[float]] = [[] for _ in range(most + 1)]
    for _ in range(repeats):
        for n in range(1, most + 1):
            began = time.perf_counter()
            _, final = target.capture(torch.ones(1, n, dtype=torch.long, device=target.device), None, layers,
                                      cache=cache, position_ids=torch.arange(context, context + n, device=target.device)[None])
            target.logits(final)
            times[n].append(time.perf_counter() - began)
            cache.crop(-n)  # transformers 5: drop the last n tokens
    return [0.0] + [sorted(t)[len(t) // 2] for t in times[1:]]


@dataclass
class NgramOptions:
    """draft=ngram / hybrid: how n-gram drafts are found (serving/ngram.py)."""

    shortest: int = 1  # the shortest suffix match that proposes
    longest: int = 4  # the longest suffix looked up (the longest match wins)
    branches: int = 1  # different continuations merged into one trie
    length: int = 10  # tokens per continuation
    head: str = "chain"  # draft=hybrid: the head's proposal the n-gram branches join (chain | tree)


@torch.no_grad()
def generate_spec(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, eos: set[int], *,
                  draft: str = "chain", steps: int = 7, min_confidence: float = 0.0, depth: int = 6, topk: int = 8,
                  total: int = 48, sampler: Sampler = GREEDY,
                  ngram: NgramOptions = NgramOptions(), schedule: AutoSchedule | None = None,
                  earlier: NgramDrafts | None = None):
    """Speculative decoding.

    draft="chain" (or a block drafter's block): up to `steps` drafts per target forward;
    `min_confidence` > 0 turns on confidence-scheduled verification: only the prefix whose running
    product of confidences (DSpark: its confidence head; the others: their top draft probability)
    stays at or above it is verified (at least one draft; `scheduled_length`). Confidences depend on
    the drafts before a position, never on its own draft, so sampling stays exact.
    draft="tree": an EAGLE-2 dynamic tree (`depth` levels, `topk` expansions per level, the
    `total` best nodes verified at once under a tree attention mask); when sampling, each expanded
    node gets `topk` i.i.d. children (see Eagle3.propose_tree), so keep `topk` small (2-3).
    draft="ngram": no head (`drafter` may be None): drafts copied from the prompt and the text so
    far (serving/ngram.py); when sampling, one continuation, each draft a point mass.
    draft="hybrid": the head's chain or tree (`ngram.head`) with the n-gram branches merged into
    one tree; when sampling, one source per forward: the n-gram continuation where the lookup
    finds one, else the head's drafts (a choice made from earlier tokens only, so exact).
    `schedule` (an AutoSchedule; chain, ngram or hybrid with a chain head): each forward verifies
    the head and n-gram draft counts with the most expected tokens per second (serving/schedule.py),
    down to none: plain decoding. It learns across calls: pass the same one for every prompt. When
    sampling, one source per forward.
    `earlier` (an NgramDrafts, draft=ngram | hybrid): the n-gram drafts also copy from it, and the
    prompt and the answer are added to it at the end; pass the same one for every prompt."""
    began = time.perf_counter()
    device = prompt_ids.device
    head = drafter if draft != "ngram" else None
    lookup = (NgramDrafts(prompt_ids[0].tolist(), ngram.shortest, ngram.longest, earlier)
              if draft in ("ngram", "hybrid") else None)
    proposal = ngram.head if draft == "hybrid" else draft
    branches = 1 if schedule or not sampler.greedy else ngram.branches
    planner = schedule
    layers = head.capture_layers() if head else []
    cache = DynamicCache()
    aux, final = target.capture(prompt_ids, None, layers, cache=cache)
    last = sampler.draw(target.logits(final[:, -1]))[0][:, None]  # the first token, from prefill
    tokens = [int(last)]
    if head:
        draft_cache = head.new_cache(cache)
        # the drafter's context, extended when it drafts next: features of positions 0..P-1, each
        # with the token that followed it
        pending = [(aux, torch.cat([prompt_ids[:, 1:], last], 1))]
    if lookup:
        lookup.extend(tokens)
    stats = Stats(target_forwards=1)  # the prefill forward gave the first token
    done = tokens[0] in eos or max_new_tokens <= 1
    while not done:
        iteration = time.perf_counter()
        length = cache.get_seq_length()  # target positions in cache; `last` sits at `length`
        remaining = max_new_tokens - len(tokens)  # never draft deeper than the tokens still to come
        found, found_parents, match = lookup.propose(min(ngram.length, remaining), branches) if lookup else ([], [], 0)
        if planner:
            head_drafts, ngram_drafts = planner.plan(head is not None, len(found), match, both=sampler.greedy)
            head_drafts = min(head_drafts, remaining)
            found, found_parents = found[:ngram_drafts], found_parents[:ngram_drafts]  # a chain: a prefix
        else:
            head_drafts = min(depth if proposal == "tree" else steps, remaining) if head else 0
            if found and not sampler.greedy:  # one proposal distribution per node: the copied drafts
                head_drafts = 0
        drafts = parents = torch.zeros(0, dtype=torch.long, device=device)
        draft_probs = None  # sampling: [1, nodes, V] the distribution each node's children came from
        head_ran = bool(head_drafts)
        if head_ran:
            drafted = time.perf_counter()
            aux_context = [torch.cat(parts, 1) for parts in zip(*(a for a, _ in pending))]
            feature, logits = head.extend(draft_cache, aux_context, torch.cat([t for _, t in pending], 1))
            extension = aux_context[0].shape[1]
            stats.head_extensions += 1
            stats.head_extended += extension
            pending, extended = [], time.perf_counter()
            if proposal == "tree":
                drafts, parents, node_dists = head.propose_tree(draft_cache, feature, logits, head_drafts, topk, total,
                                                                None if sampler.greedy else sampler.draw)
                steps_run = head_drafts - 1  # one forward per level below the first
                stats.head_drafted += len(drafts)
            else:  # a drafter may offer fewer (Medusa: one per head)
                stop = (lambda confidences: planner.stop(confidences, len(found))) if planner else None
                drafts, dists, confidence = head.propose_chain(draft_cache, feature, logits, head_drafts, sampler.draw,
                                                               stop)
                steps_run = drafts.shape[1] - 1
                stats.head_drafted += drafts.shape[1]
                confidences = confidence[0].tolist()
                keep = (planner.cut(confidences, len(found)) if planner
                        else scheduled_length(confidence[0], min_confidence))
                drafts, parents, confidences = drafts[0, :keep], torch.arange(keep, device=device), confidences[:keep]
                node_dists = F.pad(dists[0, :keep], (0, 0, 0, 1))  # node i's child came from dists[i]; the last has none
            draft_cache.crop(length)  # drop the drafter's speculative entries
            if not sampler.greedy:
                draft_probs = torch.zeros(1, len(drafts) + 1, target.spec.vocab_size, device=device)
                draft_probs[0, :, head.vocab.draft_ids.to(device)] = node_dists
            head_drafts, proposed = len(drafts), time.perf_counter()
            stats.head_extend_s += extended - drafted
            stats.head_step_s += proposed - extended
            stats.head_steps += steps_run if isinstance(head, StepDrafter) else 0  # else: one forward drafted all
            head_chain = drafts.tolist()
            stats.head_drafts += head_drafts
        if found:
            if not sampler.greedy:  # one continuation, a chain of point masses: node i's child is node i + 1
                draft_probs = torch.zeros(1, len(found) + 1, target.spec.vocab_size, device=device)
                draft_probs[0, torch.arange(len(found)), torch.tensor(found, device=device)] = 1.0
            merged = merge(drafts.tolist(), parents.tolist(), found, found_parents)  # parents: 0 is the root
            drafts, parents = (torch.tensor(x, dtype=torch.long, device=device) for x in merged)
        candidates = torch.cat([last, drafts[None]], 1)
        parents = torch.cat([torch.tensor([-1], device=device), parents])[None]  # node 0: the last token
        deepest = 0  # the deepest draft's level (not `depth`: that setting holds for every forward)
        mask = positions = None  # a plain step or a chain: the target's own causal mask and positions
        if len(drafts) and bool((parents[0, 1:] == torch.arange(len(drafts), device=device)).all()):
            deepest = len(drafts)  # a chain, verified as measure_verify_cost timed it
        elif len(drafts):
            visible = tree_ancestors(parents)  # a node sees its ancestors
            mask = torch.cat([torch.ones(1, candidates.shape[1], length, dtype=torch.bool, device=device), visible], -1)
            positions, deepest = length + visible.sum(-1) - 1, int(visible.sum(-1).max()) - 1
            mask = mask[:, None]
        verifying = time.perf_counter()
        aux, final = target.capture(candidates, mask, layers, cache=cache, position_ids=positions)
        target_logits = target.logits(final)
        verified = time.perf_counter()
        if not len(drafts):
            path, accepted, bonus = torch.zeros(1, 1, dtype=torch.long, device=device), 0, sampler.draw(target_logits[:, 0])[0][0]
        elif sampler.greedy:
            path, accepted, bonus = greedy_verify(target_logits, candidates, parents)
        else:
            nodes = candidates.shape[1]
            path, accepted, bonus = rejection_verify(sampler.probs(target_logits), draft_probs, candidates, parents,
                                                     sampler.uniforms(1, nodes, device=device),
                                                     sampler.uniforms(1, nodes, device=device))
        accepted = int(accepted)
        nodes = path[0, : accepted + 1]
        new = candidates[0, nodes[1:]].tolist() + [int(bonus)]
        stats.target_forwards += 1
        stats.count(deepest, accepted)
        stats.drafting_s += verifying - iteration
        stats.verify_forward_s += verified - verifying
        if planner:
            planner.record_forward(candidates.shape[1], verified - verifying)
            if head_ran:
                planner.record_head(confidences, common_prefix(head_chain, new), extended - drafted,
                                    (proposed - extended) / steps_run if steps_run else None, extension)
            if found:
                planner.record_ngram(match, len(found), common_prefix(found, new))
        # the accepted path's target entries move to contiguous positions; the rest is dropped
        if accepted and int(nodes[-1]) != accepted:
            compact_kv_caches([(layer.keys, layer.values) for layer in cache.layers], (length + nodes)[None],
                              torch.tensor([length], device=device), torch.tensor([accepted + 1], device=device))
        rejected = cache.get_seq_length() - (length + accepted + 1)
        if rejected:
            cache.crop(-rejected)  # transformers 5: a negative count of tokens to drop
        last = bonus.view(1, 1)
        if head:
            pending.append(([a[:, nodes] for a in aux], torch.tensor([new], device=device)))
        if lookup:
            lookup.extend(new)
        tokens.extend(new)
        tokens, done = _finish(tokens, eos, max_new_tokens)
        finished = time.perf_counter()
        stats.bookkeeping_s += finished - verified
        if planner:  # what the iteration cost besides the verification forward and the head
            planner.record_overhead(len(drafts) > 0, (verifying - iteration) + (finished - verified)
                                    - ((proposed - drafted) if head_ran else 0.0))
    if lookup and earlier is not None:
        earlier.extend(lookup.tokens[: prompt_ids.shape[1] + len(tokens)])
    stats.new_tokens = len(tokens)
    stats.seconds = time.perf_counter() - began
    return tokens, stats


def common_prefix(drafts: list[int], committed: list[int]) -> int:
    """How many of a source's chain of drafts the committed tokens accepted."""
    count = 0
    for draft, token in zip(drafts, committed[:-1]):  # the last committed token is the bonus
        if draft != token:
            break
        count += 1
    return count
