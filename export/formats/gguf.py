"""gguf format, EAGLE-3: the head as llama.cpp's draft GGUF (`llama-server -md <out>/head.gguf
--spec-type draft-eagle3`), written by llama.cpp's own converter from the speculators layout.

Lean: the token embedding is left out, so llama.cpp's EAGLE-3 reads the target's (its
src/models/eagle3.cpp takes the target's `tok_embd` where the head has none), and matrices are
stored as q8_0 (12 MB for SmolLM2's head against the converter's default 154 MB; docs/engines.md).
The converter comes from `bash scripts/install_engines.sh llamacpp-converter` (or `llamacpp`).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from drafters.config.errors import UserError
from drafters.storage.artifact import SavedDrafter
from drafters.target.model import cache_root
from export.formats import Format, register
from export.formats import speculators
from export.formats.eagle3 import EMBEDDING

LLAMA_CPP = "11434.0.0"  # scripts/install_engines.sh installs this version
HEAD_FILE = "head.gguf"


def llama_cpp_source() -> str:
    """Where install_engines.sh put llama.cpp's source, or the line that says how to get it."""
    source = os.path.join(cache_root(), "engines", f"llama.cpp-{LLAMA_CPP}")
    if not os.path.isfile(os.path.join(source, "convert_hf_to_gguf.py")):
        raise UserError(f"format=gguf: llama.cpp's converter is not installed in {source}: run "
                        "bash scripts/install_engines.sh llamacpp-converter")
    return source


def write(saved: SavedDrafter, directory: str) -> None:
    target_dir = saved.verifier.get("name_or_path") or ""
    if not os.path.isfile(os.path.join(target_dir, "config.json")):
        raise UserError("format=gguf: llama.cpp's converter reads the target as an HF dir: pass verifier_out=<dir> "
                        "(the target is written there, a GGUF one dequantized) or verifier=<HF dir>")
    if saved.hparams.get("fc_norm"):
        raise UserError("format=gguf: this head norms each aux state before fc (drafter.fc_norm=true), "
                        "which llama.cpp's EAGLE-3 does not compute")
    source = llama_cpp_source()
    layout = os.path.join(directory, "speculators")  # inside the artifact's temp dir, removed below
    lean = dataclasses.replace(saved, weights={name: w for name, w in saved.weights.items() if name != EMBEDDING})
    os.mkdir(layout)
    speculators.write(lean, layout)
    paths = [os.path.join(source, "gguf-py"), os.path.join(source, "pydeps")]
    result = subprocess.run([sys.executable, os.path.join(source, "convert_hf_to_gguf.py"), layout,
                             "--target-model-dir", target_dir, "--outtype", "q8_0",
                             "--outfile", os.path.join(directory, HEAD_FILE)],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    for name in os.listdir(layout):
        os.remove(os.path.join(layout, name))
    os.rmdir(layout)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"format=gguf: llama.cpp's converter failed ({last})")


register(Format("gguf", "eagle3", write=write))
