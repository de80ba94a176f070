"""Triton kernels with pure-torch references; no model knowledge.

Every public function takes backend="auto"|"triton"|"torch": auto runs Triton on GPU tensors
(CUDA or ROCm) and the pure-torch reference otherwise. `*_reference` / `*_triton` are the two
implementations with the same signature.
"""
from .kv import compact_kv, compact_kv_caches, compact_kv_reference, compact_kv_triton
from .verify import (
    greedy_verify,
    greedy_verify_reference,
    greedy_verify_triton,
    rejection_verify,
    rejection_verify_reference,
    rejection_verify_triton,
    tree_ancestors,
)

__all__ = [
    "compact_kv",
    "compact_kv_caches",
    "compact_kv_reference",
    "compact_kv_triton",
    "greedy_verify",
    "greedy_verify_reference",
    "greedy_verify_triton",
    "rejection_verify",
    "rejection_verify_reference",
    "rejection_verify_triton",
    "tree_ancestors",
]
