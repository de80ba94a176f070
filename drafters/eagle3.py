"""EAGLE-3 (Li et al., 2025): a one-layer draft head on fused low/mid/high target features.

Layout and weight names follow the EAGLE-3 heads served by vLLM/speculators and SGLang:
`fc` fuses the hidden states entering three target layers (3H -> H); the decoder layer attends
over concat(norm(token embedding), norm(feature)) (2H wide) with a residual from the feature; a
final norm and an lm_head over the draft vocabulary. Training unrolls K steps, each feeding the
drafter's own output feature back in (training-time test), with loss weight decay^k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from drafters.base import Captured, Drafter, greedy_draw, register
from drafters.layers import DraftCache, draft_layer_config, ttt_attention


class Eagle3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        width, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.heads, self.kv_heads = config.head_dim, heads, kv_heads
        # inputs are [embedding ; feature], hence 2 x width
        self.q_proj = nn.Linear(2 * width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v as [B, heads, T, D] with RoPE applied and kv heads expanded."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        return q, repeat_kv(k, groups), repeat_kv(v, groups)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))


class Eagle3Layer(nn.Module):
    """The draft decoder layer; `attend(q, k, v)` is TTT attention in training, cached at serving."""

    def __init__(self, config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)  # on the embedding
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)  # on the feature
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, feature, cos, sin, attend):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], -1)
        h = feature + self.self_attn.output(attend(*self.self_attn.project(x, cos, sin)))
        return h + self.mlp(self.post_attention_layernorm(h))


@register("eagle3")
class Eagle3(Drafter):
    def __init__(self, cfg, spec, vocab):
        super().__init__(cfg, spec, vocab)
        self.layer_config = draft_layer_config(spec)
        width = spec.hidden_size
        self.aux_layers = list(cfg.aux_layers) if cfg.get("aux_layers") else default_aux_layers(spec.num_layers)
        self.embed_tokens = nn.Embedding(spec.vocab_size, width).requires_grad_(False)
        self.fc = nn.Linear(len(self.aux_layers) * width, width, bias=False)
        self.midlayer = Eagle3Layer(self.layer_config)
        self.norm = LlamaRMSNorm(width, spec.rms_norm_eps)
        self.lm_head = nn.Linear(width, vocab.draft_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(self.layer_config)
        self.register_buffer("d2t", vocab.d2t.clone(), persistent=True)
        self.register_buffer("t2d", vocab.t2d.clone(), persistent=True)

    def capture_layers(self):
        return self.aux_layers

    def hparams(self):
        return {
            "aux_layers": self.aux_layers,
            "ttt_steps": int(self.cfg.ttt_steps),
            "loss_decay": float(self.cfg.loss_decay),
            "draft_vocab_size": self.vocab.draft_size,
            "layer_config": self.layer_config.to_dict(),
        }

    @torch.no_grad()
    def init_from_target(self, target):
        self.embed_tokens.weight.copy_(target.embed_weight.float())
        if self.cfg.get("init_head_from_target", True):
            # Warm start: the target's own final norm + lm_head rows of the draft vocabulary.
            self.lm_head.weight.copy_(target.lm_head_weight[self.vocab.draft_ids].float())
            self.norm.weight.copy_(target.model.model.norm.weight.float())

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(aux, -1).to(self.fc.weight.dtype))

    def loss(self, batch: dict, captured: Captured):
        input_ids = batch["input_ids"]
        length = input_ids.shape[1]
        # position t's teacher predicts token t+1, which counts only if it is an assistant token
        predicts = F.pad(batch["loss_mask"][:, 1:], (0, 1)).bool() & captured.in_vocab
        teacher = torch.softmax(captured.teacher_logits.float(), -1)
        feature = self.fuse(captured.aux)
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        keys, values = [], []

        def attend(q, key, value):
            keys.append(key)
            values.append(value)
            return ttt_attention(q, keys, values)

        total, metrics = 0.0, {}
        steps, decay = int(self.cfg.ttt_steps), float(self.cfg.loss_decay)
        for k in range(steps):
            # step k, position t: token t+1+k in, predicts token t+2+k (the teacher at t+1+k)
            shift = 1 + k
            tokens = F.pad(input_ids[:, shift:], (0, shift))
            cos, sin = self.rotary(feature, positions + k)
            feature = self.midlayer(self.embed_tokens(tokens), feature, cos, sin, attend)
            # the vocabulary-wide work (lm_head, softmax) only on rows that have a target
            rows = predicts[:, shift:]
            logits = self.lm_head(self.norm(feature[:, : length - shift][rows])).float()
            count = max(int(rows.sum()), 1)
            step_loss = F.cross_entropy(logits, teacher[:, shift:][rows], reduction="sum") / count
            total = total + decay**k * step_loss
            hits = (logits.argmax(-1) == captured.teacher_token[:, shift:][rows]).sum()
            metrics[f"acc/{k + 1}"] = hits.item() / count
            metrics[f"loss/{k + 1}"] = step_loss.item()
        return total, metrics


    # ---- serving: the same layer, run incrementally over a DraftCache

    def new_cache(self) -> DraftCache:
        return DraftCache()

    def _step(self, cache: DraftCache, tokens, feature, start: int, positions=None, mask=None):
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)
        cos, sin = self.rotary(feature, positions)
        attend = lambda q, k, v: cache.attend(q, k, v, mask)  # noqa: E731
        feature = self.midlayer(self.embed_tokens(tokens), feature, cos, sin, attend)
        return feature, self.lm_head(self.norm(feature))

    @torch.no_grad()
    def extend(self, cache: DraftCache, aux: list[torch.Tensor], next_tokens: torch.Tensor):
        """Add context entries for target positions cache.length.. : the fused target features at t
        with the token committed at t+1. Returns the last entry's (feature, draft logits)."""
        feature, logits = self._step(cache, next_tokens, self.fuse(aux), cache.length)
        return feature[:, -1:], logits[:, -1:]

    @torch.no_grad()
    def propose_chain(self, cache: DraftCache, feature, logits, steps: int, draw=None):
        """A chain of `steps` drafts (target ids) from the last context entry, feeding the drafter's
        own feature back (what TTT trained for). `draw(logits) -> (draft ids, distribution)` picks
        each draft (default: greedy); also returns the distributions [B, steps, V_draft] they came from."""
        draw = draw or greedy_draw
        tokens, dists = [], []
        for i in range(steps):
            draft, dist = draw(logits[:, -1])
            token = draft + self.d2t[draft]
            tokens.append(token)
            dists.append(dist)
            if i + 1 < steps:
                feature, logits = self._step(cache, token[:, None], feature, cache.length)
        return torch.stack(tokens, 1), torch.stack(dists, 1)

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
            mask = torch.zeros(len(frontier), context + len(cached) + len(frontier), dtype=torch.bool, device=device)
            mask[:, :context] = True
            for row, node in enumerate(frontier):
                ancestors, up = set(), parent_of[node]
                while up > 0:
                    ancestors.add(up)
                    up = parent_of[up]
                for column, other in enumerate(cached):
                    mask[row, context + column] = other in ancestors
                mask[row, context + len(cached) + row] = True
            tokens = torch.cat(node_tokens)[torch.tensor(frontier, device=device) - 1]
            positions = torch.full((1, len(frontier)), context + level - 1, device=device)
            features, step_logits = self._step(cache, (tokens + self.d2t[tokens])[None], frontier_features, 0, positions, mask)
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


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high features: inputs of layers 2, N//2 and N-3."""
    return [2, num_layers // 2, num_layers - 3]
