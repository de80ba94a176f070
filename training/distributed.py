"""The `distributed=` modes (none, ddp, zero2, zero3, fsdp) on top of Accelerate.

A launcher (`python -m training.launch`, `accelerate launch`, SLURM) only starts the processes;
the mode itself is built here from the Hydra config, so one config runs on one CPU, N processes
or N nodes. Processes talk over gloo on CPU and NCCL on GPUs (RCCL on ROCm, same name in torch).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import torch
from accelerate import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list, is_deepspeed_available
from omegaconf import DictConfig, OmegaConf

from drafters.config.errors import MainProcessFailed, UserError

DESCRIPTIONS = {
    "none": "one process",
    "ddp": "data parallel: every process holds the drafter and its optimizer, gradients all-reduced",
    "zero2": "DeepSpeed ZeRO-2: optimizer states and gradients sharded over processes",
    "zero3": "DeepSpeed ZeRO-3: parameters, gradients and optimizer states sharded over processes",
    "fsdp": "PyTorch FSDP: parameters, gradients and optimizer states sharded over processes",
}
# the modes in which every process holds whole weight matrices, as Muon needs (trainer.optimizer)
WHOLE_WEIGHTS = ("none", "ddp")
# Accelerate's name for each resolved trainer.precision (drafters/target/precision.py)
MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}
# What Accelerate must end up running for each mode; it silently falls back to plain processes
# when a plugin does not apply (FSDP on CPU), so the trainer checks.
EXPECTED_TYPES = {
    "none": {DistributedType.NO},
    "ddp": {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU},
    "zero2": {DistributedType.DEEPSPEED},
    "zero3": {DistributedType.DEEPSPEED},
    "fsdp": {DistributedType.FSDP},
}


def platform() -> str:
    """cpu | cuda | rocm: the accelerator of this machine (ROCm torch reports itself as cuda)."""
    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def local_device() -> str:
    """The device this process trains on, before Accelerate exists: cpu, or the GPU of its local rank."""
    return "cpu" if platform() == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend(device: str) -> str:
    return "gloo" if device == "cpu" else "nccl"


def check_mode(cfg: DictConfig, device: str, world: int) -> None:
    """Refuse what would run wrong, before any model loads: one line naming the fix."""
    mode = cfg.distributed.name
    if mode not in EXPECTED_TYPES:
        raise UserError(f"distributed={mode}: unknown mode ({' | '.join(EXPECTED_TYPES)})")
    if mode == "none" and world > 1:
        raise UserError(f"distributed=none trains in one process, but {world} were launched: "
                        "use distributed=ddp (or zero2, zero3, fsdp)")
    if mode in ("zero2", "zero3") and world == 1 and device == "cpu":
        raise UserError(f"distributed={mode} on CPU needs 2 or more processes (DeepSpeed's process group): "
                        "python -m training.launch launch.processes_per_node=2 ..., or distributed=none for one")
    if mode == "fsdp" and device == "cpu":
        raise UserError("distributed=fsdp needs GPUs: Accelerate enables FSDP only on CUDA/ROCm devices and would "
                        "train unsharded copies on CPU; use distributed=ddp, zero2 or zero3 here")
    if mode not in WHOLE_WEIGHTS and cfg.trainer.optimizer == "muon":
        raise UserError(f"trainer.optimizer=muon: distributed={mode} takes one optimizer over flattened or sharded "
                        "weights, Muon needs whole matrices; use distributed=ddp (or none), or trainer.optimizer=adamw")
    if mode in ("zero3", "fsdp") and cfg.trainer.eval_accept_prompts > 0:
        raise UserError(f"trainer.eval_accept_prompts needs the whole drafter in each process, which distributed={mode} "
                        "shards: set it to 0 and measure acceptance on the checkpoint with serving.bench")


def compiles(cfg: DictConfig, device: str) -> bool:
    """`trainer.compile` settled: whether the drafter's training forward runs through torch.compile
    (inductor, dynamic shapes). null: wherever it can, i.e. in one process or under DDP, on a GPU
    or on a CPU with a C++ compiler to build inductor's kernels; true: refused where it cannot."""
    wanted = cfg.trainer.get("compile")
    if wanted is False:
        return False
    mode = cfg.distributed.name
    if mode not in WHOLE_WEIGHTS:
        if wanted:
            raise UserError(f"trainer.compile=true: not with distributed={mode} (DeepSpeed and FSDP wrap the "
                            "drafter their own way); use distributed=ddp (or none), or trainer.compile=false")
        return False
    compiler = os.environ.get("CXX", "g++")
    if device == "cpu" and not shutil.which(compiler):
        if wanted:
            raise UserError(f"trainer.compile=true: torch.compile on CPU builds its kernels with a C++ compiler, and "
                            f"'{compiler}' is not on PATH: install g++ (or set CXX), or pass trainer.compile=false")
        return False
    return True


def isolate_compile_cache(device: str) -> None:
    """A directory of inductor's caches per CPU vector ISA, unless TORCHINDUCTOR_CACHE_DIR is set: its
    FX graph cache keys a CPU graph without the ISA it was built for, and a graph built under another one
    (another CPU kind sharing /tmp, or ATEN_CPU_CAPABILITY=avx2) aborts the process when reused
    (`free(): invalid pointer` at the first compiled step; torch 2.13)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the variable once it has used it: that is not the user's choice
    if device != "cpu" or os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return
    isa = str(pick_vec_isa()).replace(" ", "+")  # e.g. "avx512+avx512_vnni", "avx2"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), f"cpu-{isa}")


def deepspeed_config(cfg: DictConfig, world: int) -> dict:
    """`distributed.deepspeed` with its "auto" values filled from trainer.* (DeepSpeed needs them
    before any dataloader exists, and they must agree with how the trainer cuts batches)."""
    config = OmegaConf.to_container(cfg.distributed.deepspeed, resolve=True)
    trainer = cfg.trainer
    _fill(config, "train_micro_batch_size_per_gpu", trainer.batch_size)
    _fill(config, "gradient_accumulation_steps", trainer.grad_accum)
    _fill(config, "train_batch_size", trainer.batch_size * trainer.grad_accum * world)
    _fill(config, "gradient_clipping", trainer.grad_clip)
    if trainer.precision != "auto":  # auto (a launch plan) is resolved in each process, on its device
        _fill(config.setdefault("bf16", {}), "enabled", trainer.precision == "bfloat16", "bf16.")
        _fill(config.setdefault("fp16", {}), "enabled", trainer.precision == "float16", "fp16.")
    return config


def _fill(node: dict, key: str, value, prefix: str = "") -> None:
    if node.get(key, "auto") == "auto":
        node[key] = value
    elif node[key] != value:
        raise UserError(f"distributed.deepspeed.{prefix}{key}={node[key]} disagrees with the trainer config "
                        f"({value}): leave it auto")


def fsdp_plugin(cfg: DictConfig) -> FullyShardedDataParallelPlugin:
    options = OmegaConf.to_container(cfg.distributed.fsdp, resolve=True)
    return FullyShardedDataParallelPlugin(**options)


def make_accelerator(cfg: DictConfig, run_dir: str) -> Accelerator:
    device, world, mode = platform(), world_size(), cfg.distributed.name
    check_mode(cfg, device, world)
    plugins = {}
    if mode in ("zero2", "zero3"):
        if not is_deepspeed_available():
            raise UserError(f"distributed={mode} needs DeepSpeed: pip install --no-build-isolation deepspeed "
                            "(scripts/install.sh does)")
        plugins["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=deepspeed_config(cfg, world), zero3_init_flag=False)
    elif mode == "fsdp":
        plugins["fsdp_plugin"] = fsdp_plugin(cfg)
    accelerator = Accelerator(
        # Accelerate never runs DeepSpeed in its CPU mode; DeepSpeed brings its own CPU accelerator
        cpu=device == "cpu" and "deepspeed_plugin" not in plugins,
        mixed_precision=MIXED_PRECISION[cfg.trainer.precision],  # resolved by the trainer
        gradient_accumulation_steps=cfg.trainer.grad_accum,
        # the loop steps the schedule once per optimizer step; Accelerate would step it once per process
        step_scheduler_with_optimizer=False,
        log_with="wandb" if cfg.logger.name == "wandb" else None,
        project_dir=run_dir,
        # gloo on CPU: Accelerate would otherwise pick a backend that CPU processes lack
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if device == "cpu" and world > 1 else [],
        **plugins,
    )
    if mode == "zero3":
        # Accelerate registers the ZeRO-3 config with transformers, which would then load the frozen
        # target partitioned (zero.Init): only the drafter is sharded, the target stays whole
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    if accelerator.distributed_type not in EXPECTED_TYPES[mode]:
        raise UserError(f"distributed={mode}: Accelerate set up {accelerator.distributed_type.value} on {device} "
                        f"with {world} processes")
    return accelerator


@contextmanager
def main_process_first(state: Accelerator | PartialState):
    """Accelerate's `main_process_first`, except that the processes waiting for a main process that
    stopped on a user mistake (its error line printed) exit 2 quietly, not with gloo's traceback."""
    if not state.is_main_process:
        try:
            state.wait_for_everyone()
        except RuntimeError:
            raise MainProcessFailed("the main process failed") from None
    yield
    if state.is_main_process:
        state.wait_for_everyone()


def agree_on_run_dir(accelerator: Accelerator, run_dir: str) -> None:
    """Every process must write into one run dir (DeepSpeed checkpoints are per process); Hydra
    names it by the second each process started in, so launches pin it with hydra.run.dir."""
    if accelerator.num_processes == 1:
        return
    main_dir = broadcast_object_list([os.path.abspath(run_dir)])[0]
    if main_dir != os.path.abspath(run_dir):
        raise UserError(f"process {accelerator.process_index} runs in {run_dir}, the main process in {main_dir}: "
                        "pass hydra.run.dir=<one dir> (python -m training.launch does)")
