"""`python -m training.launch <training overrides> [launch.*=...]`: print the resolved launch
plan, then start this node's processes; `launch.dry_run=true` only prints it.

One path at every scale: one process runs the module directly, more go through `accelerate
launch` (torchrun underneath) with this node's rank, and SLURM runs this once per node
(scripts/launch/slurm.sbatch). The distributed mode itself comes from `distributed=`, inside each
process; all processes share one run dir, pinned with hydra.run.dir.
"""

from __future__ import annotations

import os
import shlex
import sys

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from drafters.config.command import command
from drafters.config.errors import BUG, USER_MISTAKE, UserError
from drafters.storage.writes import check_not_owned
from training import distributed, settings


@command("train")
def main(cfg: DictConfig) -> None:
    settings.check(cfg)
    hydra_cfg = HydraConfig.get()
    if cfg.launch.module == "training.run":  # a bad input fails here once, not once per process (dry run too)
        from training.trainer import preflight

        preflight(cfg, hydra_cfg.runtime.output_dir)
        check_not_owned(hydra_cfg.runtime.output_dir, "hydra.run.dir")
    plan, command, refused = make_plan(cfg, hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task))
    print("launch plan (dry run: nothing started)" if cfg.launch.dry_run else "launch plan")
    print(yaml.safe_dump(plan, sort_keys=False, width=1 << 16), flush=True)
    if refused:
        raise UserError(refused)
    if not cfg.launch.dry_run:
        start(command)


def start(command: list[str]) -> None:
    """Run `command`: one process replaces this one; several run under Accelerate (torchrun) in
    this process, so that when every failure is a user mistake (exit 2, its line printed by the
    main process) this exits 2 too, without torchrun's failure report."""
    if command[1:3] != ["-m", "accelerate.commands.launch"]:
        os.execv(command[0], command)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch_command(launch_command_parser().parse_args(command[3:]))
    except ChildFailedError as failed:
        rank, first = failed.get_first_failure()
        if first.exitcode == USER_MISTAKE:
            sys.exit(USER_MISTAKE)
        print(f"error: process {rank} of the run exited with code {first.exitcode} (its output is above)",
              file=sys.stderr)
        sys.exit(BUG)


def make_plan(cfg: DictConfig, run_dir: str, overrides: list[str]) -> tuple[dict, list[str], str | None]:
    """The plan as printed, the command that starts this node's processes, and why the mode cannot
    run on the plan's platform (None if it can): a refused plan still renders."""
    launch, mode = cfg.launch, cfg.distributed.name
    device = distributed.platform() if launch.platform == "auto" else str(launch.platform)
    world = int(launch.nodes) * int(launch.processes_per_node)
    dumping = launch.module == "training.dump"  # plain data parallelism, whatever `distributed` says
    refused = deepspeed = None
    try:
        if not dumping:
            distributed.check_mode(cfg, device, world)
            if mode in ("zero2", "zero3"):
                deepspeed = distributed.deepspeed_config(cfg, world)
    except UserError as error:
        refused = str(error)

    forwarded = [o for o in overrides if not o.startswith(("launch.", "hydra.run.dir="))]
    module = ["-m", str(launch.module), *forwarded, f"hydra.run.dir={run_dir}"]
    if world == 1:
        command = [sys.executable, *module]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                   "--num_machines", str(launch.nodes), "--num_processes", str(world),
                   "--machine_rank", str(launch.node_rank), "--main_process_ip", str(launch.main_address),
                   "--main_process_port", str(launch.main_port),
                   # precision and the distributed mode are set inside each process, from the config
                   "--mixed_precision", "no", "--dynamo_backend", "no", *module]

    trainer = cfg.trainer
    plan = {
        "module": str(launch.module),
        "platform": device,
        "processes": f"{launch.nodes} node(s) x {launch.processes_per_node} = {world}"
                     + (f", {distributed.backend(device)} between them" if world > 1 else ""),
    }
    if dumping:
        plan["shards"] = f"process r of {world} writes shards r, r+{world}, ... of {cfg.data.cache.dir}"
        plan["target"] = "replicated: every process runs the whole frozen target on its own shards"
    else:
        plan["distributed"] = f"{mode}: {distributed.DESCRIPTIONS[mode]}"
        plan["global batch"] = (f"{trainer.batch_size * trainer.grad_accum * world} sequences = {trainer.batch_size} per "
                                f"process x {trainer.grad_accum} accumulation x {world} processes")
        plan["hidden states"] = (f"offline, from {cfg.data.cache.dir}" if cfg.data.hidden_states == "offline"
                                 else "online: the target runs on every micro-batch")
        plan["target"] = ("replicated: every process loads the whole frozen target "
                          f"(compute dtype {cfg.target.get('dtype', 'auto')}); the drafter is what `distributed` shards")
        if deepspeed:
            plan["deepspeed"] = deepspeed
    plan["run dir"] = run_dir
    plan["command"] = shlex.join(command)
    return plan, command, refused


if __name__ == "__main__":
    main()
