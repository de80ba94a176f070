"""Triton kernels with pure-torch references; no model knowledge."""
