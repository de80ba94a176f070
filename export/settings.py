"""conf/export.yaml's schema (drafters/config/settings.py says how)."""

from __future__ import annotations

from dataclasses import dataclass

from drafters.config import settings
from drafters.config.settings import anything, at_least, nonempty, one_of


@dataclass
class Export:
    """conf/export.yaml's schema (drafters/config/settings.py): checked before anything is read."""

    checkpoint: str = nonempty()
    format: str = anything()  # export/formats names the formats
    out: str = nonempty()
    overwrite: bool = anything()
    verifier: str | None = anything()
    verifier_out: str | None = anything()
    steps: int | None = at_least(1)
    gguf_type: str = one_of("q8_0", "bf16", "f16", "f32")
    target: settings.Target = anything()
    drafter: dict = anything()  # its family's Settings (drafters/base.py: check_settings)
