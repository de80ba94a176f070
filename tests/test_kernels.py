"""Verification and KV-compaction kernels: Triton (interpreter on CPU) vs reference vs naive loops,
hand-made greedy cases, and chi-square checks that rejection sampling keeps the target distribution."""
import pytest
import torch

from conftest import CHI2_MIN_PVALUE, chi2_pvalue
from kernels import (
    compact_kv,
    compact_kv_caches,
    compact_kv_reference,
    compact_kv_triton,
    greedy_verify,
    greedy_verify_reference,
    greedy_verify_triton,
    rejection_verify,
    rejection_verify_reference,
    rejection_verify_triton,
    tree_ancestors,
)
from kernels.dispatch import use_triton
from kernels.verify import argmax_triton

# ----------------------------------------------------------------------------------- helpers


def random_parents(B, N, gen, chain=False, pad=True):
    """[B, N] parents: chains or random trees, each sequence with a random number of padding nodes."""
    parents = torch.full((B, N), -2, dtype=torch.int64)
    for b in range(B):
        n = int(torch.randint(1, N + 1, (1,), generator=gen)) if pad else N
        parents[b, 0] = -1
        for i in range(1, n):
            parents[b, i] = i - 1 if chain else int(torch.randint(0, i, (1,), generator=gen))
    return parents


def naive_greedy(logits, candidates, parents):
    """The definition, node by node."""
    B, N, _ = logits.shape
    top = logits.float().argmax(-1)
    paths, lens, bonus = torch.full((B, N), -1), torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        acc, depth = [True] + [False] * (N - 1), [0] * N
        for i in range(1, N):
            par = int(parents[b, i])
            if par >= 0 and acc[par] and top[b, par] == candidates[b, i]:
                acc[i], depth[i] = True, depth[par] + 1
        leaf = max((i for i in range(N) if acc[i]), key=lambda i: (depth[i], -i))
        path = [leaf]
        while path[-1] != 0:
            path.append(int(parents[b, path[-1]]))
        paths[b, : len(path)] = torch.tensor(path[::-1])
        lens[b], bonus[b] = len(path) - 1, top[b, leaf]
    return paths, lens, bonus


def inverse_cdf(p, u):
    c = p.cumsum(-1)
    hit = ((c > u * p.sum()) & (p > 0)).nonzero()
    return int(hit[0]) if len(hit) else int((p > 0).nonzero()[-1])


def naive_rejection(tp, dp, candidates, parents, uniforms, residual_uniforms):
    """The recursive algorithm as written in the issue, one sequence at a time."""
    B, N, _ = tp.shape
    paths, lens, bonus = torch.full((B, N), -1), torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        node, path, p = 0, [0], tp[b, 0].float()
        while True:
            q = dp[b, node].float()
            for c in [c for c in range(N) if parents[b, c] == node]:
                x = candidates[b, c]
                if uniforms[b, c] * q[x] < p[x]:
                    node, p = c, tp[b, c].float()
                    path.append(c)
                    break
                r = (p - q).clamp(min=0)
                p = r / r.sum() if r.sum() > 0 else p
            else:
                break
        paths[b, : len(path)] = torch.tensor(path)
        lens[b], bonus[b] = len(path) - 1, inverse_cdf(p, residual_uniforms[b, node].float())
    return paths, lens, bonus


def assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


# ------------------------------------------------------------------------------------ greedy

CASES = [(1, 1, 1000), (3, 1, 1000), (3, 6, 1000), (2, 9, 4097), (4, 7, 77)]
SERVING_TREE = (3, 48, 300)  # the serving tree's 48 nodes: 64 lanes in the Triton walks


@pytest.mark.parametrize("B,N,V", CASES + [SERVING_TREE])
@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_triton_matches_reference(B, N, V, chain, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + N * 10 + V + chain)
    logits = torch.randn(B, N, V, generator=gen).to(dtype)
    if dtype == torch.bfloat16:  # few distinct values: many ties, across blocks too
        logits = torch.randint(0, 8, (B, N, V), generator=gen).to(dtype)
    parents = random_parents(B, N, gen, chain=chain)
    # Mostly draft the target's own argmax so that paths get long; the rest is noise.
    top = logits.argmax(-1).gather(1, parents.clamp(min=0))
    noise = torch.randint(0, V, (B, N), generator=gen)
    candidates = torch.where(torch.rand(B, N, generator=gen) < 0.8, top, noise)
    ref = greedy_verify_reference(logits, candidates, parents)
    assert_same(greedy_verify_triton(logits, candidates, parents), ref)
    assert_same(greedy_verify(logits, candidates, parents, backend="triton"), ref)
    assert_same(naive_greedy(logits, candidates, parents), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_ties_lowest_index(dtype):
    V = 4097  # 5 blocks of 1024, the last one holding a single entry
    x = torch.zeros(4, 2, V, dtype=dtype)
    x[0, 0, [7, 3000, 4096]] = 5  # ties in different blocks
    x[0, 1, [4096]] = 5  # the maximum in the one-entry last block
    x[1, 0, [1500, 1501, 1023, 1024]] = 2  # ties inside a block and across its border
    x[2, :, :] = float("-inf")  # all equal: index 0
    x[3, 0, 1000:] = -1  # the whole vocabulary ties at 0 beyond 1000 too
    x[3, 1] = torch.arange(V, 0, -1).to(dtype)  # bf16 rounds neighbours into ties
    assert torch.equal(argmax_triton(x), x.argmax(-1))
    assert argmax_triton(x)[0, 0] == 7 and argmax_triton(x)[1, 0] == 1023


def next_token_logits(next_tokens, V=12):
    """Logits whose argmax at node n of sequence b is next_tokens[b][n]."""
    t = torch.tensor(next_tokens)
    return torch.nn.functional.one_hot(t, V).float() * 5 + 0.01 * torch.randn(*t.shape, V)


def check(result, path, accept_len, bonus):
    p, n, x = result
    assert p.tolist() == path and n.tolist() == accept_len and x.tolist() == bonus


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_hand_cases(backend):
    chain = torch.tensor([[-1, 0, 1, 2]])
    # Full acceptance on a chain: the target predicts 4, 5, 6 then 7 (the bonus).
    logits = next_token_logits([[4, 5, 6, 7]])
    check(greedy_verify(logits, torch.tensor([[9, 4, 5, 6]]), chain, backend=backend), [[0, 1, 2, 3]], [3], [7])
    # Rejection at draft position 2: the target wanted 5 after 4; the bonus is 5.
    check(greedy_verify(logits, torch.tensor([[9, 4, 8, 6]]), chain, backend=backend), [[0, 1, -1, -1]], [1], [5])
    # Rejection of the first draft: nothing accepted, bonus = the root's argmax.
    check(greedy_verify(logits, torch.tensor([[9, 3, 5, 6]]), chain, backend=backend), [[0, -1, -1, -1]], [0], [4])

    # Tree: root -> 1 (rejected), 2 (accepted); 2 -> 4 (accepted), 5 (rejected); 1 -> 3; 4 -> 6 (accepted).
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4]])
    candidates = torch.tensor([[0, 8, 1, 9, 2, 7, 3]])
    logits = next_token_logits([[1, 9, 2, 0, 3, 0, 11]])
    check(greedy_verify(logits, candidates, parents, backend=backend), [[0, 2, 4, 6, -1, -1, -1]], [3], [11])
    # Two identical accepted branches of equal depth: the lowest leaf index wins.
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    logits = next_token_logits([[1, 2, 2, 5, 5]])
    candidates = torch.tensor([[0, 1, 1, 2, 2]])
    check(greedy_verify(logits, candidates, parents, backend=backend), [[0, 1, 3, -1, -1]], [2], [5])

    # Padding nodes (-2) are never accepted even when their token matches; batch of 2.
    parents = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, -2, -2]])
    candidates = torch.tensor([[0, 4, 5, 6, 7], [0, 4, 5, 6, 7]])
    logits = next_token_logits([[4, 5, 6, 7, 8], [4, 5, 6, 7, 8]])
    check(greedy_verify(logits, candidates, parents, backend=backend),
          [[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]], [4, 2], [8, 6])


def test_tree_ancestors_and_dispatch():
    anc = tree_ancestors(torch.tensor([[-1, 0, 0, 1, -2]]))
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 1]]
    assert anc[0].int().tolist() == expected
    x = torch.zeros(1)
    assert not use_triton("auto", x) and use_triton("triton", x) and not use_triton("torch", x)
    with pytest.raises(ValueError, match="backend"):
        use_triton("cuda", x)


# --------------------------------------------------------------------------------- rejection


def random_rejection_inputs(B, N, V, chain, dtype, gen):
    parents = random_parents(B, N, gen, chain=chain)
    tp = torch.softmax(torch.randn(B, N, V, generator=gen) * 2, -1)
    dp = torch.softmax(torch.randn(B, N, V, generator=gen) * 2, -1)
    dp[:, :, :3] = 0  # draft never proposes tokens 0..2 (target can); target gives 3 no mass
    tp[:, :, 3] = 0
    dp, tp = dp / dp.sum(-1, keepdim=True), tp / tp.sum(-1, keepdim=True)
    # Candidates drawn from the parent's draft distribution, as a drafter would.
    q_par = dp.gather(1, parents.clamp(min=0)[..., None].expand(B, N, V)).reshape(B * N, V)
    candidates = torch.multinomial(q_par, 1, generator=gen).reshape(B, N)
    u, ru = torch.rand(B, N, generator=gen), torch.rand(B, N, generator=gen)
    return tp.to(dtype), dp.to(dtype), candidates, parents, u, ru


@pytest.mark.parametrize("B,N,V", CASES + [SERVING_TREE])
@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rejection_triton_matches_reference(B, N, V, chain, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + N * 10 + V + chain)
    args = random_rejection_inputs(B, N, V, chain, dtype, gen)
    ref = rejection_verify_reference(*args)
    assert_same(rejection_verify_triton(*args), ref)
    assert_same(rejection_verify(*args, backend="triton"), ref)
    assert_same(naive_rejection(*args), ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rejection_degenerate_residual(backend):
    """p == q and a forced rejection (u = 1): the residual is empty, the bonus comes from p."""
    gen = torch.Generator().manual_seed(0)
    B, V = 6, 1500
    p = torch.softmax(torch.randn(B, 2, V, generator=gen), -1)
    candidates = torch.multinomial(p[:, 0], 1, generator=gen).expand(B, 2)
    ru = torch.rand(B, 2, generator=gen)
    path, n, bonus = rejection_verify(p, p.clone(), candidates, torch.tensor([[-1, 0]] * B), torch.ones(B, 2), ru,
                                      backend=backend)
    assert n.tolist() == [0] * B and path[:, 1].tolist() == [-1] * B
    assert bonus.tolist() == [inverse_cdf(p[b, 0], ru[b, 0]) for b in range(B)]


def markov_tables(V, gen):
    """Order-1 target and draft: the distribution after a token depends on that token only.
    Each target row gives one token no mass; each draft row gives another one no mass."""
    PT, QT = torch.softmax(torch.randn(V, V, generator=gen), -1), torch.softmax(torch.randn(V, V, generator=gen), -1)
    PT[:, V - 1], QT[:, 0] = 0, 0
    return PT / PT.sum(-1, keepdim=True), QT / QT.sum(-1, keepdim=True)


def speculate(parents_row, PT, QT, root, gen):
    """One draft-and-verify step for B sequences sharing one tree; returns the emitted tokens
    (accepted drafts then the bonus) as [B, N], padded with -1."""
    B, N = root.shape[0], len(parents_row)
    tok = torch.zeros(B, N, dtype=torch.int64)
    tok[:, 0] = root
    for i in range(1, N):  # i.i.d. draws from the parent's draft distribution
        tok[:, i] = torch.multinomial(QT[tok[:, parents_row[i]]], 1, generator=gen).squeeze(1)
    parents = torch.tensor(parents_row).expand(B, N)
    u, ru = torch.rand(B, N, generator=gen), torch.rand(B, N, generator=gen)
    path, n, bonus = rejection_verify(PT[tok], QT[tok], tok, parents, u, ru, backend="torch")
    drafts = torch.where(path[:, 1:] >= 0, tok.gather(1, path[:, 1:].clamp(min=0)), -1)
    emitted = torch.cat([drafts, torch.full((B, 1), -1)], 1)
    return emitted.scatter_(1, n.unsqueeze(1), bonus.unsqueeze(1))


TREES = {
    "chain1": [-1, 0],
    "chain3": [-1, 0, 1, 2],
    "tree2": [-1, 0, 0],
    "tree3": [-1, 0, 0, 0, 1, 1],  # 3 i.i.d. children at the root, 2 under the first
}


@pytest.mark.parametrize("V", [5, 8])
@pytest.mark.parametrize("tree", TREES)
def test_rejection_preserves_target_distribution(tree, V):
    gen = torch.Generator().manual_seed(V + len(TREES[tree]))
    PT, QT = markov_tables(V, gen)
    B, root = 100_000, 2
    first = speculate(TREES[tree], PT, QT, torch.full((B,), root), gen)[:, 0]
    assert chi2_pvalue(torch.bincount(first, minlength=V), B * PT[root]) >= CHI2_MIN_PVALUE


@pytest.mark.parametrize("tree", ["chain1", "tree3"])
def test_rejection_joint_of_two_tokens(tree):
    """The first two emitted tokens ~ p(x1) p(x2 | x1), continuing with a second step when the
    first one emitted only the bonus."""
    V, B, root = 6, 100_000, 1
    gen = torch.Generator().manual_seed(7)
    PT, QT = markov_tables(V, gen)
    step1 = speculate(TREES[tree], PT, QT, torch.full((B,), root), gen)
    step2 = speculate(TREES[tree], PT, QT, step1[:, 0], gen)
    x1, x2 = step1[:, 0], torch.where(step1[:, 1] >= 0, step1[:, 1], step2[:, 0])
    assert (step1[:, 1] >= 0).any() and (step1[:, 1] < 0).any()  # both routes are exercised
    observed = torch.bincount(x1 * V + x2, minlength=V * V)
    expected = B * (PT[root][:, None] * PT).flatten()
    assert chi2_pvalue(observed, expected) >= CHI2_MIN_PVALUE


# ----------------------------------------------------------------------------------- compact_kv


def naive_compact(cache, src, dst_start, lengths):
    for b in range(cache.shape[0]):
        rows = [cache[b, :, int(src[b, j])].clone() for j in range(int(lengths[b]))]
        for j, row in enumerate(rows):
            cache[b, :, int(dst_start[b]) + j] = row


def random_compaction(B, S, L, gen):
    """Sources at or above their destinations, often overlapping them."""
    dst_start = torch.randint(0, S - L, (B,), generator=gen)
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    lengths[0] = L
    src = torch.zeros(B, L, dtype=torch.int64)
    for b in range(B):  # increasing positions in [dst, S): an accepted path inside the tree slots
        src[b] = torch.randperm(S - int(dst_start[b]), generator=gen)[:L].sort().values + dst_start[b]
    return src, dst_start, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("B,H,S,D,L", [(1, 1, 8, 4, 5), (3, 2, 64, 16, 20), (2, 3, 100, 200, 40)])
def test_compact_kv(dtype, B, H, S, D, L):
    gen = torch.Generator().manual_seed(S + D + L)
    cache = torch.randn(B, H, S, D, generator=gen).to(dtype)
    src, dst_start, lengths = random_compaction(B, S, L, gen)
    expected = cache.clone()
    naive_compact(expected, src, dst_start, lengths)
    for fn in (compact_kv_reference, compact_kv_triton):
        out = cache.clone()
        fn(out, src, dst_start, lengths)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compact_kv_overlap_patterns(backend):
    """Shift down by one (each destination is the next row's source), a shift by 8 < L, the
    identity, on a contiguous cache and on a strided [B, S, H, D] view of one."""
    S, L = 50, 37
    cache = torch.randn(2, 2, S, 8)
    src = torch.stack([torch.arange(L) + 1, torch.arange(L) + 5])
    dst_start, lengths = torch.tensor([0, 5]), torch.tensor([L, L])
    expected = cache.clone()
    naive_compact(expected, src, dst_start, lengths)
    compact_kv(cache, src, dst_start, lengths, backend=backend)
    assert torch.equal(cache, expected)

    bshd = torch.randn(2, S, 3, 8)  # what some engines store; the kernel sees its [B, H, S, D] view
    view, expected = bshd.transpose(1, 2), bshd.transpose(1, 2).clone()
    src = torch.stack([torch.arange(10, 10 + L), torch.arange(3, 3 + L)])  # the second one: identity
    naive_compact(expected, src, torch.tensor([2, 3]), torch.tensor([L, 20]))
    compact_kv(view, src, torch.tensor([2, 3]), torch.tensor([L, 20]), backend=backend)
    assert torch.equal(view, expected)


def test_compact_kv_caches():
    gen = torch.Generator().manual_seed(1)
    caches = [(torch.randn(2, 2, 30, 4, generator=gen), torch.randn(2, 2, 30, 4, generator=gen)) for _ in range(3)]
    src, dst_start, lengths = random_compaction(2, 30, 6, gen)
    expected = [(k.clone(), v.clone()) for k, v in caches]
    for k, v in expected:
        naive_compact(k, src, dst_start, lengths)
        naive_compact(v, src, dst_start, lengths)
    compact_kv_caches(caches, src, dst_start, lengths, backend="triton")
    for (k, v), (ek, ev) in zip(caches, expected):
        assert torch.equal(k, ek) and torch.equal(v, ev)


# ------------------------------------------------------------------------- real GPU compilation

AOT = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.kv import _compact_kernel
from kernels.verify import _argmax_kernel, _greedy_walk_kernel, _rejection_walk_kernel

BV = {"BLOCK_V": 1024}
jobs = [
    (_argmax_kernel, "x_ptr:*bf16 out_ptr:*i64 N:i32 V:i32 stride_b:i32 stride_n:i32", BV),
    (_greedy_walk_kernel, "top_ptr:*i64 cand_ptr:*i64 parents_ptr:*i64 path_ptr:*i64 accept_ptr:*i64 bonus_ptr:*i64 "
     "N:i32", {"BLOCK_N": 64}),
    (_rejection_walk_kernel, "p_ptr:*fp32 q_ptr:*bf16 cand_ptr:*i64 parents_ptr:*i64 u_ptr:*fp32 ru_ptr:*fp32 "
     "path_ptr:*i64 accept_ptr:*i64 bonus_ptr:*i64 N:i32 V:i32", BV | {"BLOCK_N": 64}),
    (_compact_kernel, "cache_ptr:*fp16 src_ptr:*i64 dst_ptr:*i64 len_ptr:*i64 D:i32 s_b:i32 s_h:i32 "
     "s_s:i32 s_d:i32 s_src:i32", {"BLOCK_L": 16, "BLOCK_D": 128}),
]
for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):  # H100, MI300X
    for fn, sig, const in jobs:
        signature = dict(a.split(":") for a in sig.split()) | {k: "constexpr" for k in const}
        compile(ASTSource(fn=fn, signature=signature, constexprs=const), target=target)
"""


def test_kernels_compile_for_h100_and_mi300x(tmp_path):
    """The interpreter accepts code the compiler rejects: compile every kernel to a CUDA cubin
    and an AMD hsaco ahead of time (no GPU needed), in a process without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    import triton.backends

    if not {"nvidia", "amd"} <= set(triton.backends.backends):
        pytest.skip("this Triton build lacks the nvidia or amd backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", AOT], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
