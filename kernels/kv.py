"""KV-cache compaction after verification: move the accepted path's entries into contiguous slots.

compact_kv(cache [B, H, S, D], src [B, L], dst_start [B], lengths [B]) copies, in place,
cache[b, :, src[b, j]] -> cache[b, :, dst_start[b] + j] for j < lengths[b] (<= L).
Sources must not lie below their destinations: src[b, j] >= dst_start[b] + j (the tree's
entries sit after the committed prefix), so ranges may overlap only "downwards".
"""
import torch
import triton
import triton.language as tl

from .dispatch import on_device, use_triton

BLOCK_L = 16  # path entries moved per step


@triton.jit
def _compact_kernel(cache_ptr, src_ptr, dst_ptr, len_ptr, D, s_b, s_h, s_s, s_d, s_src,
                    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.load(len_ptr + b)
    dst = tl.load(dst_ptr + b)
    base = cache_ptr + b * s_b + h * s_h
    col = offs_d[None, :] * s_d
    # Steps go in increasing j. A step's destinations may be sources of the same step (read all
    # first, then write) or of earlier steps (already read), never of later ones, because
    # src[j] >= dst + j > dst + k for every k < j.
    for j0 in range(0, n, BLOCK_L):
        j = j0 + tl.arange(0, BLOCK_L)
        m = (j < n)[:, None] & (offs_d < D)[None, :]
        src = tl.load(src_ptr + b * s_src + j, mask=j < n, other=0)
        rows = tl.load(base + src[:, None] * s_s + col, mask=m)
        tl.debug_barrier()  # every thread has read its sources before any destination is written
        tl.store(base + (dst + j)[:, None] * s_s + col, rows, mask=m)


def compact_kv_triton(cache, src, dst_start, lengths):
    B, H, _, D = cache.shape
    block_d = min(triton.next_power_of_2(D), 128)
    grid = (H, B, triton.cdiv(D, block_d))
    src = src.contiguous()
    with on_device(cache):
        _compact_kernel[grid](cache, src, dst_start.contiguous(), lengths.contiguous(), D, *cache.stride(),
                              src.stride(0), BLOCK_L=BLOCK_L, BLOCK_D=block_d)


def compact_kv_reference(cache, src, dst_start, lengths):
    j = torch.arange(src.shape[1], device=src.device)
    b, j = (j < lengths.unsqueeze(1)).nonzero(as_tuple=True)
    # The right-hand side is gathered into a new tensor before the write: overlap is safe.
    cache[b, :, dst_start[b] + j] = cache[b, :, src[b, j]]


def compact_kv(cache, src, dst_start, lengths, *, backend="auto") -> None:
    """In place: cache[b, :, dst_start[b] + j] = cache[b, :, src[b, j]] for j < lengths[b]."""
    if use_triton(backend, cache):
        compact_kv_triton(cache, src, dst_start, lengths)
    else:
        compact_kv_reference(cache, src, dst_start, lengths)


def compact_kv_caches(caches, src, dst_start, lengths, *, backend="auto") -> None:
    """compact_kv on every tensor of a list of (key, value) caches (one pair per layer)."""
    for pair in caches:
        for cache in pair:
            compact_kv(cache, src, dst_start, lengths, backend=backend)
