"""conf/train.yaml's schema (training.run, training.dump, training.launch): checked right after Hydra
composes the config, before any model loads (drafters/config/settings.py says how)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from drafters.base import check_settings
from drafters.config import settings
from drafters.config.errors import UserError
from drafters.config.settings import PRECISIONS, above, anything, at_least, between, nonempty, one_of


@dataclass
class Trainer:
    max_steps: int = at_least(1)
    max_minutes: float | None = above(0)
    deadline_minutes: float | None = above(0)
    batch_size: int = at_least(1)
    grad_accum: int = at_least(1)
    group_by_length: bool = anything()
    compile: bool | None = anything()  # null: wherever it can (training/distributed.py: compiles)
    optimizer: str = one_of("auto", "adamw", "muon")
    ns_steps: int = at_least(1)  # Muon's Newton-Schulz iterations
    lr: float = at_least(0)  # 0: the weights stay as they start (a check of init_from)
    weight_decay: float = at_least(0)
    warmup_steps: int = at_least(0)
    schedule: str = one_of("cosine", "constant")
    min_lr_ratio: float = between(0, 1)
    grad_clip: float = above(0)
    precision: str = one_of(*PRECISIONS)
    log_every: int = at_least(1)
    eval_every: int = at_least(1)
    eval_doubling: bool = anything()
    eval_max_samples: int = at_least(1)
    eval_accept_prompts: int = at_least(0)
    eval_accept_tokens: int = at_least(1)
    save_every: int = at_least(1)
    keep_last: int = at_least(0)  # 0 keeps every checkpoint
    resume: str = anything()  # no | auto | a checkpoint dir (training/checkpoint.find)


@dataclass
class Regeneration:
    max_new_tokens: int = at_least(1)
    batch_size: int = at_least(1)
    temperature: float = at_least(0)
    max_minutes: float | None = above(0, auto=True)  # auto: by the hardware (training/trainer.py: settle_regen_minutes)


@dataclass
class HiddenStateCache:
    dir: str = anything()
    dtype: str = one_of("bf16", "fp8")
    shard_sequences: int = at_least(1)
    batch_size: int = at_least(1)


@dataclass
class Data:
    path: str | None = anything()
    max_samples: int | None = at_least(1)
    max_length: int = at_least(2)  # a trained position needs a token before it
    eval_fraction: float = between(0, 1)
    eval_min: int = at_least(0)
    loss_on: str = one_of("answers", "all")
    regenerate: bool = anything()
    regen: Regeneration = anything()
    hidden_states: str = one_of("online", "offline", "cached")
    cache: HiddenStateCache = anything()


@dataclass
class Logger:
    name: str = one_of("wandb", "none")
    project: str | None = anything()
    mode: str | None = one_of("offline", "online", "disabled")


@dataclass
class Distributed:
    name: str = one_of("none", "ddp", "fsdp", "zero2", "zero3")
    fsdp: dict | None = anything()  # Accelerate's FSDP plugin settings, passed as they are
    deepspeed: dict | None = anything()  # a DeepSpeed config, passed as it is


@dataclass
class Launch:
    nodes: int = at_least(1)
    processes_per_node: int = at_least(1)
    node_rank: int = at_least(0)
    main_address: str = anything()
    main_port: int = between(1, 65535)
    platform: str = one_of("auto", "cpu", "cuda", "rocm")
    module: str = one_of("training.run", "training.dump")
    dry_run: bool = anything()


@dataclass
class Train:
    seed: int = between(0, 2**32 - 1)  # numpy's seed range
    run_name: str = anything()
    cache_dir: str = nonempty()
    trainer: Trainer = anything()
    data: Data = anything()
    logger: Logger = anything()
    distributed: Distributed = anything()
    launch: Launch = anything()
    target: settings.Target = anything()
    drafter: dict = anything()  # its family's Settings (drafters/base.py: check_settings)


def check(cfg: DictConfig) -> None:
    """Every key of a training config, the drafter's own included, and what keys say together."""
    settings.check(cfg, Train)
    settings.check_target(cfg.target)
    check_settings(cfg.drafter)
    if cfg.launch.node_rank >= cfg.launch.nodes:
        raise UserError(f"launch.node_rank={cfg.launch.node_rank}: must be below launch.nodes={cfg.launch.nodes}")
    address = str(cfg.launch.main_address).strip()
    if cfg.launch.nodes > 1 and (not address or address == "localhost" or address.startswith("127.")):
        raise UserError(f"launch.main_address={address}: with launch.nodes={cfg.launch.nodes}, pass node 0's "
                        "address as the other nodes reach it (the same on every node)")
