"""`precision=auto`: the compute dtype chosen from the hardware the process runs on.

bf16 where the hardware computes it natively (CUDA/ROCm GPUs that support it; x86 CPUs with
AVX512-BF16 or AMX; ARM CPUs with BF16), fp16 on GPUs where only that is fast, fp32 everywhere
else: on an AVX2-only CPU a bf16 matmul is emulated and measured 40-120x slower than fp32.

What torch reports decides; where it is ambiguous (the bf16 instructions exist but torch's kernels
may not use them: an ATen dispatch level below AVX512, a capped oneDNN ISA, ARM), a one-off
micro-benchmark of a bf16 against an fp32 matmul does. Explicit values win, with one warning line
when they are slow on this hardware.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable, Mapping

import torch

from drafters.config.errors import UserError

log = logging.getLogger("specdraft")

# what a user may write (trainer.precision, target.dtype, serving dtype) -> the dtype it names
NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
         "fp32": torch.float32, "float32": torch.float32}
CHOICES = "auto | bf16 | fp16 | fp32 (or bfloat16, float16, float32)"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Hardware:
    """What the precision was chosen for (recorded beside every figure and in checkpoints)."""

    device: str  # cpu | cuda | rocm
    name: str  # CPU model or GPU name
    capability: str  # CPU: torch's kernel dispatch level (AVX2, AVX512, ...); GPU: sm_90, gfx942, ...
    native_bf16: bool
    native_fp16: bool
    evidence: str  # how native_bf16 was decided: what torch reports, or the measured slowdown
    threads: int

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """e.g. `CPU AVX2: no native bf16 (no bf16 instructions reported)`, `CUDA sm_90 (NVIDIA H200)`."""
        if self.device == "cpu":
            return f"CPU {self.capability}: {'native' if self.native_bf16 else 'no native'} bf16 ({self.evidence})"
        return f"{self.device.upper()} {self.capability} ({self.name})"


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    requested: str
    hardware: Hardware

    @property
    def name(self) -> str:
        """bfloat16 | float16 | float32: the canonical spelling, what configs record once resolved."""
        return dtype_name(self.dtype)

    def describe(self) -> str:
        """e.g. `float32 (auto)`, `bfloat16 (as set)`."""
        return f"{self.name} ({'auto' if self.requested == 'auto' else 'as set'})"


def cpu_bf16_from_report(caps: Mapping, dispatch: str, isa_capped: bool) -> bool | None:
    """Native bf16 on this CPU from what torch reports: True, False, or None when the report does
    not settle it (the instructions are there, but torch's kernels may not use them)."""
    if not any(caps.get(flag) for flag in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")):
        return False
    if caps.get("architecture") in ("x86_64", "x86") and dispatch.startswith("AVX512") and not isa_capped:
        return True
    return None


def gpu_support(major: int, minor: int, rocm: bool) -> tuple[bool, bool]:
    """(native bf16, fast fp16) of a GPU of compute capability major.minor: bf16 as
    `torch.cuda.is_bf16_supported(including_emulation=False)` decides it (Ampere on, every ROCm GPU),
    read from the properties so that no CUDA context is made; fp16 tensor cores from Volta on (and
    P100's fast fp16), every ROCm GPU."""
    return rocm or major >= 8, rocm or major >= 7 or (major, minor) == (6, 0)


def choose(requested: str, hardware: Hardware) -> torch.dtype:
    if requested != "auto":
        return NAMES[requested]
    if hardware.native_bf16:
        return torch.bfloat16
    if hardware.native_fp16 and hardware.device != "cpu":
        return torch.float16
    return torch.float32


def matmul_slowdown(dtype: torch.dtype, device: str = "cpu", repeats: int = 3) -> float:
    """Time of a small matmul in `dtype` over the same in float32 (best of `repeats`; a few ms)."""

    def best(kind: torch.dtype) -> float:
        a = torch.randn(64, 256, device=device).to(kind)
        b = torch.randn(256, 256, device=device).to(kind)
        a @ b  # first call: kernel selection, allocation
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - began)
        return min(times)

    return best(dtype) / max(best(torch.float32), 1e-9)


def cpu_hardware(caps: Mapping, dispatch: str, isa_capped: bool, measure: Callable[[], float]) -> Hardware:
    reported = cpu_bf16_from_report(caps, dispatch, isa_capped)
    if reported is None:
        slowdown = measure()
        native, evidence = slowdown < 1.0, f"bf16 matmul measured {slowdown:.2g}x the time of fp32"
    else:
        native = reported
        evidence = "AVX512-BF16/AMX reported" if native else "no bf16 instructions reported"
    name = str(caps.get("cpu_name") or "unknown CPU")
    return Hardware("cpu", name, dispatch, native, False, evidence, torch.get_num_threads())


def cpu_capabilities(get=getattr(torch.cpu, "get_capabilities", None)) -> Mapping:
    """torch.cpu.get_capabilities(); a torch without it (older releases) gets the bf16 flags from
    Linux's /proc/cpuinfo (elsewhere none: the benchmark then decides for ARM, fp32 for x86)."""
    if get is not None:
        return get()
    flags: set[str] = set()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            flags = {word for line in handle if line.startswith(("flags", "Features")) for word in line.split()}
    return {"architecture": platform.machine(), "cpu_name": platform.processor(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "bf16": "bf16" in flags, "sve_bf16": "svebf16" in flags}


@lru_cache(maxsize=None)
def probe(device_type: str, index: int = 0) -> Hardware:
    """This process's hardware of `device_type` (cpu | cuda), probed once."""
    if device_type == "cpu":
        # ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY cap what torch's kernels use below what the CPU has
        capped = bool(os.environ.get("ONEDNN_MAX_CPU_ISA"))
        return cpu_hardware(cpu_capabilities(), torch.backends.cpu.get_cpu_capability(), capped,
                            lambda: matmul_slowdown(torch.bfloat16))
    properties = torch.cuda.get_device_properties(index)
    rocm = bool(torch.version.hip)
    capability = properties.gcnArchName if rocm else f"sm_{properties.major}{properties.minor}"
    native_bf16, native_fp16 = gpu_support(properties.major, properties.minor, rocm)
    return Hardware("rocm" if rocm else "cuda", properties.name, capability, native_bf16, native_fp16,
                    "reported by torch", torch.get_num_threads())


def canonical(value, key: str = "precision") -> str:
    """auto, or the dtype's own name (bf16 -> bfloat16, ...); `key` names the setting in errors."""
    requested = str(value).lower()
    if requested == "auto":
        return requested
    if requested not in NAMES:
        raise UserError(f"{key}={value}: unknown precision ({CHOICES})")
    return dtype_name(NAMES[requested])


@lru_cache(maxsize=None)
def _resolve(requested: str, device_type: str, index: int) -> Precision:
    hardware = probe(device_type, index)
    precision = Precision(choose(requested, hardware), requested, hardware)
    if requested != "auto":
        warn_if_slow(precision)
    return precision


def resolve(value, device: str | torch.device = "cpu", key: str = "precision") -> Precision:
    """The compute dtype for `value` (auto or an explicit name) on `device`; once per process."""
    device = torch.device(device)
    index = 0 if device.type == "cpu" or device.index is None else device.index
    return _resolve(canonical(value, key), device.type, index)


def warn_if_slow(precision: Precision) -> None:
    """One warning line for an explicit half precision the hardware only emulates."""
    hw = precision.hardware
    if precision.dtype == torch.float32:
        return
    native = hw.native_bf16 if precision.dtype == torch.bfloat16 else hw.native_fp16
    if native:
        return
    if hw.device == "cpu":
        slowdown = matmul_slowdown(precision.dtype)
        if slowdown >= 1.5:
            log.warning("precision %s as set, but this CPU (%s) has no native %s: a matmul measured %.0fx slower "
                        "than in float32 here (precision=auto picks %s)", precision.name, hw.capability,
                        precision.name, slowdown, dtype_name(choose("auto", hw)))
    else:
        log.warning("precision %s as set, but %s (%s) does not compute it natively (precision=auto picks %s)",
                    precision.name, hw.name, hw.capability, dtype_name(choose("auto", hw)))
