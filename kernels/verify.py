"""Verification of a draft tree (a chain is parents[i] = i - 1) against the target's outputs.

Per sequence b there are N nodes in topological order: node 0 is the root (the last committed
token), node i > 0 holds draft token candidates[b, i] under parent node parents[b, i] < i
(parents[b, 0] = -1; padding nodes have -2 and are never accepted). Both verifiers return
  path [B, N] int64: node indices of the accepted root-to-node path, starting at 0, padded with -1
  accept_len [B] int64: accepted draft tokens (path length - 1)
  bonus [B] int64: the token the target adds after the path

Triton does the vocabulary-wide work (argmax; residual max(0, p - q) and its normalization;
inverse-CDF sampling). The walk over the N nodes is a handful of [B, N] torch ops, shared by the
Triton and the reference paths so that the two differ only in the vocabulary kernels.
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


def _greedy(target_logits, candidates, parents, argmax):
    B, N, _ = target_logits.shape
    top = argmax(target_logits)  # [B, N]: the target's token after each node
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


def greedy_verify_reference(target_logits, candidates, parents):
    return _greedy(target_logits, candidates, parents, lambda x: x.argmax(-1))


def greedy_verify_triton(target_logits, candidates, parents):
    return _greedy(target_logits, candidates, parents, argmax_triton)


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
def _residual_kernel(p_ptr, q_ptr, rows_ptr, V, BLOCK_V: tl.constexpr):
    # p[row] <- normalize(max(0, p[row] - q[row])) in place, for rows >= 0 (one per sequence).
    row = tl.load(rows_ptr + tl.program_id(0))
    if row >= 0:
        p_row = p_ptr + row * V
        q_row = q_ptr + row * V
        offs = tl.arange(0, BLOCK_V)
        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            m = start + offs < V
            p = tl.load(p_row + start + offs, mask=m, other=0.0)
            q = tl.load(q_row + start + offs, mask=m, other=0.0).to(tl.float32)
            acc += tl.maximum(p - q, 0.0)
        total = tl.sum(acc, axis=0)
        # total == 0 means p == q: the rejection had no mass to move; keep sampling from p.
        if total > 0:
            for start in range(0, V, BLOCK_V):
                m = start + offs < V
                p = tl.load(p_row + start + offs, mask=m, other=0.0)
                q = tl.load(q_row + start + offs, mask=m, other=0.0).to(tl.float32)
                tl.store(p_row + start + offs, tl.maximum(p - q, 0.0) / total, mask=m)


@triton.jit
def _sample_kernel(p_ptr, rows_ptr, u_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    # Inverse CDF: the first index whose cumulative mass exceeds u * total (and has mass).
    b = tl.program_id(0)
    p_row = p_ptr + tl.load(rows_ptr + b) * V
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        acc += tl.load(p_row + start + offs, mask=start + offs < V, other=0.0)
    target = tl.load(u_ptr + b) * tl.sum(acc, axis=0)
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
    tok = tl.where(first < V, first, tl.maximum(last, 0))
    tl.store(out_ptr + b, tok.to(tl.int64))


def _residual_torch(p, q, rows):
    """Reference of _residual_kernel: p, q [M, V] (p float32, updated in place), rows [B]."""
    r = rows[rows >= 0]
    res = (p[r] - q[r].float()).clamp(min=0)
    total = res.sum(-1, keepdim=True)
    p[r] = torch.where(total > 0, res / total, p[r])


def _sample_torch(p, rows, u):
    """Reference of _sample_kernel: one token per entry of rows, from p[rows] with uniforms u."""
    x = p[rows]
    V = x.shape[-1]
    idx = torch.arange(V, device=x.device)
    c = x.cumsum(-1)
    first = torch.where((x > 0) & (c > u.unsqueeze(-1) * x.sum(-1, keepdim=True)), idx, V).min(-1).values
    last = torch.where(x > 0, idx, -1).max(-1).values
    return torch.where(first < V, first, last.clamp(min=0))


def _residual_triton(p, q, rows):
    with on_device(p):
        _residual_kernel[(rows.shape[0],)](p, q, rows, p.shape[-1], BLOCK_V=BLOCK_V)


def _sample_triton(p, rows, u):
    out = torch.empty_like(rows)
    with on_device(p):
        _sample_kernel[(rows.shape[0],)](p, rows, u.contiguous(), out, p.shape[-1], BLOCK_V=BLOCK_V)
    return out


def _rejection(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms, residual, sample):
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
        residual(p, q, torch.where(is_child & ~accept, row, -1))
        slot = torch.where(accept, n_acc + 1, 0)  # column 0 is rewritten with itself (0)
        path.scatter_(1, slot.unsqueeze(1), torch.where(accept, i, 0).unsqueeze(1))
        n_acc += accept.long()
        cur = torch.where(accept, i, cur)
    u_bonus = residual_uniforms.float().gather(1, cur.unsqueeze(1)).squeeze(1)
    return path, n_acc, sample(p, base + cur, u_bonus)


def rejection_verify_reference(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms):
    return _rejection(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms,
                      _residual_torch, _sample_torch)


def rejection_verify_triton(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms):
    return _rejection(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms,
                      _residual_triton, _sample_triton)


def rejection_verify(target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms, *,
                     backend="auto"):
    """Sampling verification. target_probs[b, n]: target distribution at node n; draft_probs[b, n]:
    the distribution node n's children were drawn from (i.i.d.); uniforms[b, c] decides child c,
    residual_uniforms[b, n] draws the bonus when the walk stops at node n."""
    args = (target_probs, draft_probs, candidates, parents, uniforms, residual_uniforms)
    if use_triton(backend, target_probs):
        return rejection_verify_triton(*args)
    return rejection_verify_reference(*args)
