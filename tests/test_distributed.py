"""Scale-out on CPU: 2 processes over gloo, started by `python -m training.launch` as a user would.

DDP and DeepSpeed ZeRO-2/3 must reach the weights of one process with the same global batch (2
processes x 1 sequence = 1 process x 2 accumulated micro-batches), and resume from their own
checkpoints (ZeRO-2); the launch plan renders without starting anything, and what cannot run is refused
with one line."""

import itertools
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch._inductor.runtime.cache_dir_utils import cache_dir

from conftest import ROOT, one_line_error, records, run_cli
from drafters.config.errors import UserError
from training.distributed import compiles, isolate_compile_cache

BASE = ["target=tiny_llama", "data.max_samples=60", "data.max_length=160", "logger=none", "trainer.precision=fp32",
        "trainer.schedule=constant", "trainer.warmup_steps=3", "trainer.log_every=1", "trainer.eval_every=100",
        "trainer.eval_max_samples=4", "trainer.save_every=2", "trainer.batch_size=1"]
ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
PORTS = itertools.count(29531)  # a fresh rendezvous port per launch
# what ZeRO runs (`auto`, the full preset's, is Muon for one process and DDP where bf16 is native: compared on its own below)
ADAMW = "trainer.optimizer=adamw"
MUON = "trainer.optimizer=muon"


def launch(run_dir, *overrides):
    result = subprocess.run(
        [sys.executable, "-m", "training.launch", *BASE, *overrides, f"launch.main_port={next(PORTS)}",
         f"hydra.run.dir={run_dir}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def weights(run_dir, step):
    return load_file(os.path.join(run_dir, "checkpoints", f"step-{step}", "model.safetensors"))


def assert_same_weights(mine, reference, rtol=1e-5, atol=1e-6):
    assert mine.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(mine[name], tensor, rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, 2 accumulated micro-batches of 1 sequence, 4 steps."""
    run_dir = tmp_path_factory.mktemp("one-process")
    output = launch(run_dir, ADAMW, "trainer.grad_accum=2", "trainer.max_steps=4")
    assert "global batch 2 = 1 per process x 2 accumulation x 1 processes" in output
    return run_dir


def test_compiled_graphs_are_cached_per_cpu_vector_isa(monkeypatch):
    if not shutil.which("g++"):
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    isolate_compile_cache("cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"  # the user's choice stands
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    isolate_compile_cache("cuda")  # GPU graphs are keyed by the device already
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    cache_dir()  # inductor, once it has run, writes its default into the variable: still not the user's choice
    isolate_compile_cache("cpu")
    here = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert os.path.basename(here) == "cpu-" + str(pick_vec_isa()).replace(" ", "+")
    # the same machine with torch capped to AVX2 (how this project measures that kind) gets a directory of its own
    capped = subprocess.run(
        [sys.executable, "-c", ("import os; from training.distributed import isolate_compile_cache; "
                                "isolate_compile_cache('cpu'); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")],
        env={k: v for k, v in {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.dirname(capped) == os.path.dirname(here) and os.path.basename(capped) == "cpu-avx2"


@pytest.mark.long
@pytest.mark.xdist_group("one_process")
@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile on CPU needs a C++ compiler")
def test_a_compiled_run_learns_what_the_eager_one_does(one_process, tmp_path):
    """trainer.compile=true: the same losses step by step and the same weights, within float tolerance
    (inductor fuses the element-wise work, so not bitwise), saved under the eager run's names."""
    output = launch(tmp_path, ADAMW, "trainer.grad_accum=2", "trainer.max_steps=4", "trainer.compile=true")
    assert "runs through torch.compile" in output
    losses = [[r["train/loss"] for r in records(run) if "train/loss" in r] for run in (tmp_path, one_process)]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert_same_weights(weights(tmp_path, 4), weights(one_process, 4), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("wanted, mode, compiler, expected", [
    (False, "none", "g++", False),
    (None, "none", "g++", True),
    (None, "ddp", "g++", True),
    (None, "zero2", "g++", False),  # null: wherever it can, silently
    (None, "none", "no-such-c++", False),
    (True, "none", "g++", True),
    (True, "zero3", "g++", "trainer.compile=true: not with distributed=zero3"),
    (True, "none", "no-such-c++", "'no-such-c++' is not on PATH"),
])
def test_compile_runs_wherever_it_can_and_refuses_an_explicit_true_where_it_cannot(monkeypatch, wanted, mode, compiler,
                                                                                      expected):
    if compiler == "g++" and not shutil.which("g++"):
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("CXX", compiler)
    cfg = OmegaConf.create({"trainer": {"compile": wanted}, "distributed": {"name": mode}})
    if isinstance(expected, str):
        with pytest.raises(UserError, match=re.escape(expected)):
            compiles(cfg, "cpu")
    else:
        assert compiles(cfg, "cpu") is expected
    if mode in ("none", "ddp"):  # a GPU builds with Triton, no C++ compiler needed
        assert compiles(cfg, "cuda") is (wanted is not False)


@pytest.mark.long
@pytest.mark.xdist_group("one_process")  # one worker builds the reference for all three
@pytest.mark.parametrize("mode", ["ddp", "zero2"])
def test_two_processes_match_one(one_process, tmp_path, mode):
    output = launch(tmp_path, ADAMW, "launch.processes_per_node=2", f"distributed={mode}", "trainer.max_steps=2")
    assert "global batch 2 = 1 per process x 1 accumulation x 2 processes" in output
    assert_same_weights(weights(tmp_path, 2), weights(one_process, 2))
    if mode == "zero2":  # DeepSpeed's own checkpoint: one optimizer shard per process...
        shards = os.listdir(tmp_path / "checkpoints" / "step-2" / "pytorch_model")
        assert sum(name.endswith("optim_states.pt") for name in shards) == 2, shards
        # ...which a resumed run reads back (DDP resumes through the one-process path of test_training)
        output = launch(tmp_path, ADAMW, "launch.processes_per_node=2", "distributed=zero2", "trainer.max_steps=4",
                        "trainer.resume=auto")
        assert "resumed from" in output and "at step 2" in output
        assert_same_weights(weights(tmp_path, 4), weights(one_process, 4))


@pytest.mark.long
@pytest.mark.xdist_group("one_process")
def test_zero3_shards_the_drafter_not_the_target(one_process, tmp_path):
    launch(tmp_path, ADAMW, "launch.processes_per_node=2", "distributed=zero3", "trainer.max_steps=4")
    assert_same_weights(weights(tmp_path, 4), weights(one_process, 4))  # gathered at save


@pytest.mark.long
def test_ddp_with_muon_matches_one_process(tmp_path):
    """Muon (`auto`'s choice under DDP where bf16 is native) under DDP: orthogonalized updates of the
    all-reduced gradients, as in one process."""
    assert "optimizer muon" in launch(tmp_path / "one", MUON, "trainer.grad_accum=2", "trainer.max_steps=2")
    launch(tmp_path / "ddp", MUON, "launch.processes_per_node=2", "distributed=ddp", "trainer.max_steps=2")
    assert_same_weights(weights(tmp_path / "ddp", 2), weights(tmp_path / "one", 2))


def plan(tmp_path, capsys, *overrides):
    return run_cli("training.launch", ["launch.dry_run=true", *overrides, f"hydra.run.dir={tmp_path}"], capsys)


def test_dry_run_renders_a_multi_node_plan_and_starts_nothing(tmp_path, capsys):
    result = plan(tmp_path, capsys, "target=llama3_8b", "distributed=zero3", "launch.platform=rocm", "launch.nodes=4",
                  "launch.processes_per_node=8", "launch.node_rank=3", "launch.main_address=10.1.0.1",
                  "trainer.grad_accum=2")
    assert result.returncode == 0, result.stderr[-2000:]
    shown = result.stdout
    assert "dry run: nothing started" in shown and "4 node(s) x 8 = 32, nccl between them" in shown
    assert "global batch: 256 sequences = 4 per process x 2 accumulation x 32 processes" in shown
    for filled in ("train_micro_batch_size_per_gpu: 4", "gradient_accumulation_steps: 2", "train_batch_size: 256",
                   "gradient_clipping: 0.5", "stage: 3"):
        assert filled in shown, filled
    for argument in ("--num_machines 4", "--num_processes 32", "--machine_rank 3", "--main_process_ip 10.1.0.1",
                     "-m training.run target=llama3_8b distributed=zero3 trainer.grad_accum=2"):
        assert argument in shown, argument
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("overrides, fragment", [
    (["distributed=fsdp", "launch.processes_per_node=2"], "distributed=fsdp needs GPUs"),
    (["distributed=none", "launch.processes_per_node=2"], "use distributed=ddp"),
    (["distributed=zero2", "launch.processes_per_node=2", "distributed.deepspeed.train_micro_batch_size_per_gpu=8"],
     "leave it auto"),
    (["distributed=zero2"], "distributed=zero2 on CPU needs 2 or more processes"),
    (["distributed=zero2", "launch.processes_per_node=2", "trainer.optimizer=muon"], "trainer.optimizer=muon: distributed=zero2"),
])
def test_what_cannot_run_still_renders_then_is_refused_in_one_line(tmp_path, capsys, overrides, fragment):
    result = plan(tmp_path, capsys, "target=tiny_llama", *overrides)
    assert "launch plan" in result.stdout
    one_line_error(result, fragment)


def test_fsdp_renders_for_gpus_and_is_refused_by_the_trainer_on_cpu(tmp_path, capsys):
    assert plan(tmp_path / "plan", capsys, "distributed=fsdp", "launch.platform=cuda",
                "launch.processes_per_node=8").returncode == 0
    result = run_cli("training.run", [*BASE, "distributed=fsdp", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    one_line_error(result, "distributed=fsdp needs GPUs")


def test_slurm_script_starts_each_node_with_its_rank(tmp_path):
    """scripts/launch/slurm.sbatch under stand-ins for scontrol and srun (srun runs the task as node 1 of 2)."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    (stand_ins / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (stand_ins / "srun").write_text('#!/bin/sh\nshift\nSLURM_NODEID=1 exec "$@"\n')  # drops --kill-on-bad-exit
    for tool in stand_ins.iterdir():
        tool.chmod(0o755)
    env = {**ENV, "PATH": f"{stand_ins}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_SUBMIT_DIR": ROOT, "RUN_DIR": str(tmp_path / "run")}
    result = subprocess.run(["bash", "scripts/launch/slurm.sbatch", "launch.dry_run=true", "distributed=zero2"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "platform: rocm" in result.stdout
    assert ("--num_machines 2 --num_processes 16 --machine_rank 1 --main_process_ip gpu-a" in result.stdout)
    assert f"distributed=zero2 hydra.run.dir={tmp_path / 'run'}" in result.stdout
