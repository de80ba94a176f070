"""Artifact formats: one small writer per format and drafter, plus a reader where the format is
another engine's (to import its heads), found through a registry.

A format module calls `register(Format(...))` when imported, and every module of this package is
imported on first lookup: a new drafter adds its formats as modules here, with no per-format
branching in drafters/ or export/run.py.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from drafters.artifact import SavedDrafter
from drafters.errors import UserError
from drafters.target import Target

ANY_DRAFTER = "*"


@dataclass(frozen=True)
class ImportFor:
    """What importing another engine's head takes from our side."""

    target: Target  # the target it will run on (its spec; its embedding where the head ships none)
    target_cfg: dict  # the conf/target node that loads it, recorded in the artifact
    drafter_cfg: dict  # our config of the drafter it becomes (defaults for what their files lack)


@dataclass(frozen=True)
class Format:
    name: str  # format=<name>
    drafter: str  # the drafter it writes and reads (ANY_DRAFTER: all)
    write: Callable[[SavedDrafter, str], None]  # the artifact's files into an empty directory
    recognizes: Callable[[dict], bool] | None = None  # another engine's format: is a config.json ours to read
    read: Callable[[str, dict, ImportFor], SavedDrafter] | None = None  # (dir, its config.json, ...) -> ours

    def write_checked(self, saved: SavedDrafter, directory: str, where: str) -> None:
        """Keys and shapes are checked before anything is written: a bad checkpoint never becomes an artifact."""
        saved.check_weights(where)
        self.write(saved, directory)


FORMATS: list[Format] = []


def register(fmt: Format) -> None:
    FORMATS.append(fmt)


def _discover() -> list[Format]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return FORMATS


def named(name: str) -> list[Format]:
    """The formats called `name` (one per drafter), or the one-line error listing the known names."""
    found = [fmt for fmt in _discover() if fmt.name == name]
    if not found:
        raise UserError(f"unknown format '{name}' (available: {', '.join(sorted({fmt.name for fmt in FORMATS}))})")
    return found


def writer(name: str, drafter: str) -> Format:
    candidates = named(name)
    for fmt in candidates:
        if fmt.drafter in (drafter, ANY_DRAFTER):
            return fmt
    raise UserError(f"format '{name}' has no writer for drafter '{drafter}' "
                    f"(it has: {', '.join(fmt.drafter for fmt in candidates)})")


def reader(config: dict, where: str) -> Format:
    """The format whose reader takes a dir with this config.json."""
    for fmt in _discover():
        if fmt.recognizes and fmt.recognizes(config):
            return fmt
    readable = ", ".join(f"{fmt.name} ({fmt.drafter})" for fmt in FORMATS if fmt.read)
    raise UserError(f"{where}: config.json is no layout this version reads "
                    f"(a specdraft checkpoint or native artifact, or {readable})")
