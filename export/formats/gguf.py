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

from drafters.config.errors import UserError
from drafters.storage.artifact import SavedDrafter
from drafters.storage.engines import convert_to_gguf, llama_cpp_source
from export.formats import Format, register
from export.formats import speculators
from export.formats.eagle3 import EMBEDDING

HEAD_FILE = "head.gguf"


def write(saved: SavedDrafter, directory: str, gguf_type: str = "q8_0") -> None:
    target_dir = saved.verifier.get("name_or_path") or ""
    if not os.path.isfile(os.path.join(target_dir, "config.json")):
        raise UserError("format=gguf: llama.cpp's converter reads the target as an HF dir: pass verifier_out=<dir> "
                        "(the target is written there, a GGUF one dequantized) or verifier=<HF dir>")
    if saved.hparams.get("fc_norm"):
        raise UserError("format=gguf: this head norms each aux state before fc (drafter.fc_norm=true), "
                        "which llama.cpp's EAGLE-3 does not compute")
    llama_cpp_source()  # its one-line error before any work
    layout = os.path.join(directory, "speculators")  # inside the artifact's temp dir, removed below
    lean = dataclasses.replace(saved, weights={name: w for name, w in saved.weights.items() if name != EMBEDDING})
    os.mkdir(layout)
    speculators.write(lean, layout)
    try:
        convert_to_gguf(layout, os.path.join(directory, HEAD_FILE), gguf_type, target_dir=target_dir)
    finally:
        for name in os.listdir(layout):
            os.remove(os.path.join(layout, name))
        os.rmdir(layout)


register(Format("gguf", "eagle3", write=write, options=("gguf_type",)))
