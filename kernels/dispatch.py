"""Backend choice shared by the kernels: Triton on GPU (CUDA or ROCm), pure torch elsewhere."""
import contextlib
import os

import torch

BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, x: torch.Tensor) -> bool:
    """True when `backend` (for tensors like `x`) means the Triton kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return x.is_cuda  # also True on ROCm builds of torch
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before `kernels` is imported"
        )
    return backend == "triton"


def on_device(x: torch.Tensor):
    """Launch on x's GPU: Triton launches on the current device, which may be another one."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
