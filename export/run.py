"""`python -m export.run checkpoint=<dir> format=native|speculators|sglang|vllm|... out=<dir>`: write an
artifact (export/formats/ registers which format writes which drafter).

`checkpoint=` is one of ours (a training checkpoint or a native artifact), or a head in another
engine's layout (EAGLE-3: speculators, SGLang/SpecForge/EAGLE; EAGLE-1: vLLM, SGLang, the EAGLE
repo; Medusa: vLLM, the Medusa repo), imported for `target=` as the drafter its format reads. The
artifact is written to a temp dir beside `out` and renamed into place when complete.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from drafters.base import check_settings
from drafters.config import settings
from drafters.config.command import command
from drafters.config.errors import UserError
from drafters.storage.artifact import CONFIG_FILE, NATIVE_FORMAT, SavedDrafter, read, read_json
from drafters.storage.writes import STATE_FILE, atomic_directory, check_directory_destination
from drafters.target.model import load_target, resolve_path
from export import formats
from export.settings import Export


def drafter_yaml(name: str) -> DictConfig:
    """conf/drafter/<name>.yaml with the drafter configs its `defaults` list builds on merged under it
    (dspark.yaml extends dflash.yaml)."""
    node = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "drafter", f"{name}.yaml"))
    parents = [drafter_yaml(parent) for parent in node.pop("defaults", []) if parent != "_self_"]
    return OmegaConf.merge(*parents, node)


def drafter_config(cfg: DictConfig, name: str) -> dict:
    """Our config of drafter `name`, which an imported head becomes: `drafter=` where it names that
    drafter, else conf/drafter/<name>.yaml's defaults (so no `drafter=` needs to match the dir)."""
    drafter = cfg.drafter
    if drafter.name != name:
        target = OmegaConf.to_container(cfg.target, resolve=True)  # what its ${target.*} fields read
        drafter = OmegaConf.create({"target": target, "drafter": drafter_yaml(name)}).drafter
    return OmegaConf.to_container(drafter, resolve=True)


def read_source(cfg: DictConfig) -> SavedDrafter:
    path = str(cfg.checkpoint)
    config_file = os.path.join(path, CONFIG_FILE)
    if os.path.isfile(os.path.join(path, STATE_FILE)) or not os.path.isfile(config_file):
        return read(path)  # a training checkpoint, or read's one-line error
    config = read_json(config_file, path)
    if config.get("format") == NATIVE_FORMAT:
        return read(path)
    fmt = formats.reader(config, path)  # before the target loads: an unknown layout fails fast
    context = formats.ImportFor(load_target(cfg.target), OmegaConf.to_container(cfg.target, resolve=True),
                                drafter_config(cfg, fmt.drafter))
    saved = fmt.read(path, config, context)
    saved.check(path)
    return saved


def write_verifier(saved: SavedDrafter, out: str, overwrite: bool, protect: tuple[str, ...]) -> str:
    """The target as an HF safetensors dir (a GGUF target dequantized) in bf16, whatever precision the
    head was trained in (float32 where the target is configured so, as tiny test targets are): what
    vLLM and speculators load by path. Returns that path."""
    kept = saved.target.get("dtype") in ("float32", "fp32")
    target_cfg = OmegaConf.merge(saved.target, {"dtype": "float32" if kept else "bfloat16"})
    source = None if target_cfg.get("random_init") else resolve_path(target_cfg)
    protect = (*protect, source) if source and os.path.exists(source) else protect  # never over the model it reads
    check_directory_destination(out, overwrite, protect, "verifier_out", model=True)  # before the target loads
    target = load_target(target_cfg)
    saved.check_target(target.spec, out)
    with atomic_directory(out, overwrite, protect, key="verifier_out", model=True) as partial:
        target.model.save_pretrained(partial)
        target.tokenizer.save_pretrained(partial)
    return os.path.abspath(out)


def export(cfg: DictConfig) -> str:
    """Write the artifact; returns the line that says what was written."""
    settings.check(cfg, Export)
    settings.check_target(cfg.target)
    check_settings(cfg.drafter)
    formats.named(cfg.format)  # an unknown format fails before any work
    checkpoint, out = str(cfg.checkpoint), os.path.abspath(str(cfg.out))
    if not os.path.isdir(checkpoint):
        raise UserError(f"checkpoint not found: {cfg.checkpoint}")
    verifier = str(cfg.verifier or "")
    if verifier.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(verifier)):
        raise UserError(f"verifier={verifier}: no such model directory (pass an HF dir or a hub id)")
    if cfg.verifier_out:  # refused before any work, like out
        check_directory_destination(str(cfg.verifier_out), cfg.overwrite, (checkpoint, out), "verifier_out", model=True)
    with atomic_directory(out, cfg.overwrite, protect=(checkpoint,)) as partial:
        saved = read_source(cfg)
        fmt = formats.writer(cfg.format, saved.drafter)
        if cfg.steps:
            saved.proposal["steps"] = int(cfg.steps)
        if cfg.verifier_out:
            saved.verifier["name_or_path"] = write_verifier(saved, cfg.verifier_out, cfg.overwrite, (checkpoint, out))
        elif cfg.verifier:
            saved.verifier["name_or_path"] = str(cfg.verifier)
        fmt.write_checked(saved, partial, str(cfg.checkpoint), **{name: cfg[name] for name in fmt.options})
    return (f"wrote {fmt.name} artifact {out}: {saved.drafter} for target {saved.verifier['name']}, "
            f"aux layers {saved.skeleton().capture_layers()} (input of layer k), "
            f"verifier {saved.verifier['name_or_path'] or '(none recorded)'}")


@command("export")
def main(cfg: DictConfig) -> None:
    print(export(cfg))


if __name__ == "__main__":
    main()
