"""Verification of a draft tree (a chain is parents[i] = i - 1) against the target's outputs.

Per sequence b there are N nodes in topological order: node 0 is the root (the last committed
token), node i > 0 holds draft token candidates[b, i] under parent node parents[b, i] < i
(parents[b, 0] = -1; padding nodes have -2 and are never accepted). Both verifiers return
  path [B, N] int64: node indices of the accepted root-to-node path, starting at 0, padded with -1
  accept_len [B] int64: accepted draft tokens (path length - 1)
  bonus [B] int64: the token the target adds after the path

Triton does the vocabulary-wide work (argmax; residual max(0, p - q) and its normalization;
inverse-CDF sampling) and walks the tree too, one program per sequence with the node-sized state
in registers. The torch references walk it in ~25 small ops (greedy) or a loop over the nodes
(rejection): launches that cost far more on a GPU than the vocabulary work (docs/gpu.md).
"""
import torch
import triton
import triton.language as tl

from .dispatch import on_device, use_triton

BLOCK_V = 1024  # vocabulary slice per loop iteration; V need not be a multiple of it


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """anc[b, i, j] = node j is node i or one of its ancestors ([B, N, N] bool).

    This is also the tree attention mask. Built by squaring the parent relation log2(N) times
    rather than walking the tree node by node. Padding nodes see only themselves.
    """
    B, N = parents.shape
    anc = torch.eye(N, device=parents.device).expand(B, N, N).clone()
    has_parent = (parents >= 0).float().unsqueeze(-1)
    anc.scatter_add_(2, parents.clamp(min=0).unsqueeze(-1), has_parent)
    for _ in range((N - 1).bit_length()):  # after k squarings: ancestors up to 2**k levels up
        anc = (anc @ anc > 0).float()  # 0/1 entries and counts <= N: exact even in TF32
    return anc.bool()


# ---------------------------------------------------------------------------------------------
# Greedy: node i is accepted iff its parent is and argmax(logits[parent]) == candidates[i].


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, N, V, stride_b, stride_n, BLOCK_V: tl.constexpr):
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = x_ptr + b * stride_b + n * stride_n
    offs = tl.arange(0, BLOCK_V)
    # Each lane keeps the first maximum it has seen (strict >), so ties resolve to the lowest
    # index like torch.argmax. Masked lanes read -inf and never win against a real entry.
    best = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best_idx = offs
    for start in range(BLOCK_V, V, BLOCK_V):
        x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, start + offs, best_idx)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_idx, V), axis=0)
    tl.store(out_ptr + b * N + n, idx.to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for [B, N, V] logits, fused over the vocabulary (NaN unsupported)."""
    B, N, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, N, dtype=torch.int64, device=logits.device)
    with on_device(logits):
        _argmax_kernel[(N, B)](logits, out, N, V, logits.stride(0), logits.stride(1), BLOCK_V=BLOCK_V)
    return out


@triton.jit
def _greedy_walk_kernel(top_ptr, cand_ptr, parents_ptr, path_ptr, accept_ptr, bonus_ptr, N,
                        BLOCK_N: tl.constexpr):
    # One program per sequence; the N nodes live in registers (lane i = node i), and scalars are
    # read out of a lane by a masked sum: lanes of one program give no ordering between stores and
    # loads, registers need none.
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inside = offs < N
    top = tl.load(top_ptr + b * N + offs, mask=inside, other=0)
    cand = tl.load(cand_ptr + b * N + offs, mask=inside, other=0)
    parents = tl.load(parents_ptr + b * N + offs, mask=inside, other=-2).to(tl.int32)  # int32 like the lanes it is compared with
    accepted = offs == 0
    depth = tl.zeros([BLOCK_N], dtype=tl.int32)
    for i in range(1, N):  # parents come first: node i's parent is settled when i is reached
        node = offs == i
        parent = tl.sum(tl.where(node, parents, 0))
        at_parent = offs == parent  # nothing for the padding's -2
        ok = ((parent >= 0) & (tl.sum(tl.where(at_parent, accepted.to(tl.int32), 0)) > 0)
              & (tl.sum(tl.where(at_parent, top, 0)) == tl.sum(tl.where(node, cand, 0))))
        accepted = accepted | (node & ok)
        depth = tl.where(node, tl.sum(tl.where(at_parent, depth, 0)) + 1, depth)
    deepest = tl.max(tl.where(accepted, depth, -1), axis=0)
    leaf = tl.min(tl.where(accepted & (depth == deepest), offs, BLOCK_N), axis=0)  # the lowest index
    path = tl.full([BLOCK_N], -1, tl.int32)
    node = leaf
    for _ in range(0, N):  # up from the leaf, each node written at its depth; -1 above the root writes nothing
        level = tl.sum(tl.where(offs == node, depth, 0))
        path = tl.where((offs == level) & (node >= 0), node, path)
        node = tl.where(node >= 0, tl.sum(tl.where(offs == node, parents, 0)), -1)
    tl.store(path_ptr + b * N + offs, path.to(tl.int64), mask=inside)
    tl.store(accept_ptr + b, deepest.to(tl.int64))
    tl.store(bonus_ptr + b, tl.sum(tl.where(offs == leaf, top, 0)).to(tl.int64))


def greedy_verify_reference(target_logits, candidates, parents):
    B, N, _ = target_logits.shape
    top = target_logits.argmax(-1)  # [B, N]: the target's token after each node
    anc = tree_ancestors(parents)
    ok = (parents >= 0) & (top.gather(1, parents.clamp(min=0)) == candidates)
    ok[:, 0] = True
    accepted = ~(anc & ~ok.unsqueeze(1)).any(-1)  # every node on the root path passed
    depth = anc.sum(-1) - 1
    leaf = torch.where(accepted, depth, -1).argmax(-1)  # deepest; argmax picks the lowest index
    on_path = anc[torch.arange(B, device=anc.device), leaf]
    # Topological order: sorting the path's node indices puts it in root-to-leaf order.
    nodes = torch.arange(N, device=anc.device).expand(B, N)
    path = torch.where(on_path, nodes, N).sort(-1).values
    path = torch.where(path == N, -1, path)
    return path, on_path.sum(-1) - 1, top.gather(1, leaf.unsqueeze(1)).squeeze(1)


def greedy_verify_triton(target_logits, candidates, parents):
    B, N, _ = target_logits.shape
    top = argmax_triton(target_logits)
    path = torch.empty(B, N, dtype=torch.int64, device=top.device)
    accept_len, bonus = (torch.empty(B, dtype=torch.int64, device=top.device) for _ in range(2))
    with on_device(top):
        _greedy_walk_kernel[(B,)](top, candidates.to(torch.int64).contiguous(), parents.to(torch.int64).contiguous(),
                                  path, accept_len, bonus, N, BLOCK_N=triton.next_power_of_2(N))
    return path, accept_len, bonus


def greedy_verify(target_logits, candidates, parents, *, backend="auto"):
    """Greedy (lossless) verification: target_logits [B, N, V] float/bf16 -> (path, accept_len, bonus)."""
    if use_triton(backend, target_logits):
        return greedy_verify_triton(target_logits, candidates, parents)
    return greedy_verify_reference(target_logits, candidates, parents)


# ---------------------------------------------------------------------------------------------
# Rejection sampling: multi-candidate recursive version (SpecInfer / EAGLE). At the current node
# with target p and draft q, each child x (i.i.d. from q) is accepted with prob min(1, p(x)/q(x));
# on rejection p <- normalize(max(0, p - q)) and the next child is tried. When no child is
# accepted, the bonus is drawn from the current p. This keeps the target distribution exactly.


@triton.jit
def _residual_row(p_row, q_row, V, BLOCK_V: tl.constexpr):
    # p <- normalize(max(0, p - q)) in place; total == 0 means p == q: the rejection had no mass to
    # move, so sampling goes on from p. Each lane writes only what it read itself.
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        m = start + offs < V
        p = tl.load(p_row + start + offs, mask=m, other=0.0)
        q = tl.load(q_row + start + offs, mask=m, other=0.0).to(tl.float32)
        acc += tl.maximum(p - q, 0.0)
    total = tl.sum(acc, axis=0)
    if total > 0:
        for start in range(0, V, BLOCK_V):
            m = start + offs < V
            p = tl.load(p_row + start + offs, mask=m, other=0.0)
            q = tl.load(q_row + start + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(p_row + start + offs, tl.maximum(p - q, 0.0) / total, mask=m)


@triton.jit
def _sample_row(p_row, u, V, BLOCK_V: tl.constexpr):
    # Inverse CDF: the first index whose cumulative mass exceeds u * total (and has mass).
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        acc += tl.load(p_row + start + offs, mask=start + offs < V, other=0.0)
    target = u * tl.sum(acc, axis=0)
    carry = 0.0
    first = V
    last = -1  # last index with mass: the answer if rounding puts u * total past the end
    for start in range(0, V, BLOCK_V):
        m = start + offs < V
        p = tl.load(p_row + start + offs, mask=m, other=0.0)
        c = carry + tl.cumsum(p, axis=0)
        hit = m & (p > 0) & (c > target)
        first = tl.minimum(first, tl.min(tl.where(hit, start + offs, V), axis=0))
        last = tl.maximum(last, tl.max(tl.where(m & (p > 0), start + offs, -1), axis=0))
        carry = tl.max(c, axis=0)  # the running total (p >= 0; masked lanes add 0)
    return tl.where(first < V, first, tl.maximum(last, 0))


@triton.jit
def _rejection_walk_kernel(p_ptr, q_ptr, cand_ptr, parents_ptr, u_ptr, ru_ptr, path_ptr, accept_ptr, bonus_ptr,
                           N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    # One program per sequence walks its nodes as the reference does, with the node-sized state in
    # registers (scalars read out of a lane by a masked sum) and p [B * N, V] its float32 working copy.
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inside = offs < N
    cand = tl.load(cand_ptr + b * N + offs, mask=inside, other=0)
    parents = tl.load(parents_ptr + b * N + offs, mask=inside, other=-2).to(tl.int32)
    u = tl.load(u_ptr + b * N + offs, mask=inside, other=1.0)
    path = tl.where(offs == 0, 0, -1)
    cur = 0
    accepted = 0
    for i in range(1, N):
        node = offs == i
        row = (b * N + cur) * V
        x = tl.sum(tl.where(node, cand, 0))
        px = tl.load(p_ptr + row + x)
        qx = tl.load(q_ptr + row + x).to(tl.float32)
        is_child = tl.sum(tl.where(node, parents, 0)) == cur  # padding (-2) never matches
        accept = is_child & (tl.sum(tl.where(node, u, 0.0)) * qx < px)  # u < p/q without dividing by q = 0
        if is_child & ~accept:
            # Lanes of one program are not in step: barriers keep every lane's read of p[row, x] before
            # the residual rewrites the row, and the rewrite before the next child's read.
            tl.debug_barrier()
            _residual_row(p_ptr + row, q_ptr + row, V, BLOCK_V)
            tl.debug_barrier()
        accepted = accepted + accept.to(tl.int32)
        path = tl.where(accept & (offs == accepted), i, path)
        cur = tl.where(accept, i, cur)
    bonus = _sample_row(p_ptr + (b * N + cur) * V, tl.load(ru_ptr + b * N + cur), V, BLOCK_V)
    tl.store(path_ptr + b * N + offs, path.to(tl.int64), mask=inside)
    tl.store(accept_ptr + b, accepted.to(tl.int64))
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


def _residual_torch(p, q, rows):
    """p[rows] <- normalize(max(0, p - q)) (kept where that has no mass): p, q [M, V], p float32 in place."""
    r = rows[rows >= 0]
    res = (p[r] - q[r].float()).clamp(min=0)
    total = res.sum(-1, keepdim=True)
    p[r] = torch.where(total > 0, res / total, p[r])


def _sample_torch(p, rows, u):
    """One token per entry of rows, from p[rows] by inverse CDF with uniforms u."""
    x = p[rows]
    V = x.shape[-1]
    idx = torch.arange(V, device=x.device)
    c = x.cumsum(-1)
    first = torch.where((x > 0) & (c > u.unsqueeze(-1) * x.sum(-1, keepdim=True)), idx, V).min(-1).values
    last = torch.where(x > 0, idx, -1).max(-1).values
    return torch.where(first < V, first, last.clamp(min=0))


def rejection_verify_reference(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms):
    B, N, V = target_probs.shape
    dev = target_probs.device
    # Work copy in float32, [B * N, V]: the current distribution of sequence b is always row
    # b * N + cur[b]: a node's row is untouched until its own children are tried. (One float32
    # copy of target_probs; it spares gathering/copying rows each time the walk moves.)
    p = torch.empty(B * N, V, dtype=torch.float32, device=dev)
    p.copy_(target_probs.reshape(B * N, V))
    q = draft_probs.reshape(B * N, V).contiguous()
    base = torch.arange(B, device=dev) * N
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    path = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    n_acc = torch.zeros(B, dtype=torch.int64, device=dev)
    # Children have larger indices than their parents, so one pass over the nodes in order
    # visits every child of the current node after the node itself was reached.
    for i in range(1, N):
        row = base + cur
        x = candidates[:, i]
        is_child = parents[:, i] == cur  # padding (-2) never matches
        px, qx = p[row, x], q[row, x].float()
        accept = is_child & (uniforms[:, i] * qx < px)  # u < p/q without dividing by q = 0
        _residual_torch(p, q, torch.where(is_child & ~accept, row, -1))
        slot = torch.where(accept, n_acc + 1, 0)  # column 0 is rewritten with itself (0)
        path.scatter_(1, slot.unsqueeze(1), torch.where(accept, i, 0).unsqueeze(1))
        n_acc += accept.long()
        cur = torch.where(accept, i, cur)
    u_bonus = residual_uniforms.float().gather(1, cur.unsqueeze(1)).squeeze(1)
    return path, n_acc, _sample_torch(p, base + cur, u_bonus)


def rejection_verify_triton(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms):
    B, N, V = target_probs.shape
    p = torch.empty(B * N, V, dtype=torch.float32, device=target_probs.device)  # the walk's working copy
    p.copy_(target_probs.reshape(B * N, V))
    path = torch.empty(B, N, dtype=torch.int64, device=p.device)
    accept_len, bonus = (torch.empty(B, dtype=torch.int64, device=p.device) for _ in range(2))
    with on_device(p):
        _rejection_walk_kernel[(B,)](
            p, draft_probs.reshape(B * N, V).contiguous(), candidates.to(torch.int64).contiguous(),
            parents.to(torch.int64).contiguous(), uniforms.float().contiguous(), residual_uniforms.float().contiguous(),
            path, accept_len, bonus, N, V, BLOCK_N=triton.next_power_of_2(N), BLOCK_V=BLOCK_V)
    return path, accept_len, bonus


def rejection_verify(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms, *,
                     backend="auto"):
    """Sampling verification. target_probs[b, n]: target distribution at node n; draft_probs[b, n]:
    the distribution node n's children were drawn from (i.i.d.); uniforms[b, c] decides child c,
    residual_uniforms[b, n] draws the bonus when the walk stops at node n."""
    args = (target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms)
    if use_triton(backend, target_probs):
        return rejection_verify_triton(*args)
    return rejection_verify_reference(*args)
