"""End-to-end runs of `python -m training.run` on the tiny random target (and one on SmolLM2)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import (FAMILIES, ROOT, TINY_RUN, compose_train, distilled_setup, kill_while_writing, one_line_error,
                      random_drafter, records)
from drafters.base import capture
from drafters.storage.artifact import read
from drafters.target import precision
from training.schedule import Muon, make_optimizers, newton_schulz, optimizer_name
from training.trainer import settle_regen_minutes


def command(run_dir, *overrides):
    return [sys.executable, "-m", "training.run", *TINY_RUN, f"hydra.run.dir={run_dir}", *overrides]


def train(run_dir, *overrides, env=None, timeout=300):
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def test_run_dir_layout_metrics_plots_and_wandb(tmp_path):
    run_dir = tmp_path / "run"
    result = train(run_dir, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=2", "trainer.log_every=1",
                   "logger=wandb", f"cache_dir={tmp_path / 'cache'}", "trainer.eval_accept_prompts=2",
                   "trainer.eval_accept_tokens=8")
    assert result.returncode == 0, result.stderr[-3000:]
    logged = records(run_dir)
    assert [r["step"] for r in logged if "train/loss" in r] == [1, 2, 3, 4]
    train_keys = set(logged[0])
    assert {"train/loss", "perf/tokens_per_s", *(f"train/acc/{k}" for k in range(1, 4))} <= train_keys  # the default unroll: 3
    evals = [r for r in logged if "eval/sim_accept_len" in r]
    assert [r["step"] for r in evals] == [2, 4]
    seen = {r["step"]: r["train/tokens"] for r in logged if "train/loss" in r}  # cumulative: a curve's axis
    assert 0 < seen[1] < seen[2] < seen[3] < seen[4] and all(r["train/tokens"] == seen[r["step"]] for r in evals)
    assert {"eval/loss", "eval/vocab_coverage", *(f"eval/acc/{k}" for k in range(1, 4))} <= set(evals[0])
    # the expected tokens per forward of a 3-draft chain with these per-position acceptances
    acc = [evals[-1][f"eval/acc/{k}"] for k in range(1, 4)]
    assert evals[-1]["eval/sim_accept_len"] == pytest.approx(1 + sum(torch.tensor(acc).cumprod(0).tolist()))
    assert 1.0 <= evals[-1]["eval/accept_len"] <= 4.0  # measured by the serving engine
    assert sorted(os.listdir(run_dir / "plots")) == ["acceptance_by_position.png", "loss.png", "sim_accept_len.png"]
    assert os.path.realpath(run_dir / "checkpoints" / "latest") == str(run_dir / "checkpoints" / "step-4")
    state = json.loads((run_dir / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["drafter"] == "eagle3" and state["target"] == "tiny-llama"
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline_runs, "W&B offline run missing"
    assert "final eval/sim_accept_len" in result.stderr + result.stdout
    assert f"serve it: python -m serving.run artifact={run_dir / 'checkpoints' / 'latest'}" in result.stderr + result.stdout


@pytest.mark.long
def test_sigkill_while_saving_then_resume_is_bitwise_identical(tmp_path):
    """Killed while its step-8 checkpoint is being written or renamed into place, resumed, killed
    again while saving step 12, resumed again: `latest` is whole after each kill, and the run ends
    bitwise where an uninterrupted run ends."""
    settings = ["trainer.max_steps=16", "trainer.save_every=4", "trainer.eval_every=100", "trainer.log_every=1",
                "logger=none", "trainer.keep_last=10"]
    # every run on one thread, as kill_while_writing's are: on some CPUs (Intel with AMX, 2026-12-02) a
    # bf16 matmul on one thread and on two round differently
    one_thread = {"OMP_NUM_THREADS": "1"}
    reference = tmp_path / "reference"
    assert train(reference, *settings, env=one_thread).returncode == 0

    interrupted = tmp_path / "interrupted"
    for step, delay in ((8, 0.042), (12, 0.007)):  # late and early in the write
        resume = ["trainer.resume=auto"] if step > 8 else []
        assert kill_while_writing(command(interrupted, *settings, *resume), delay,
                                  str(interrupted / "checkpoints" / f".step-{step}.partial-*")), "it finished first"
        latest = os.path.realpath(interrupted / "checkpoints" / "latest")
        read(latest).build(latest)  # whole: the previous checkpoint or the new one
        assert os.path.basename(latest) in (f"step-{step - 4}", f"step-{step}")

    result = train(interrupted, *settings, "trainer.resume=auto", env=one_thread)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {latest}" in result.stdout + result.stderr
    final = load_file(interrupted / "checkpoints" / "step-16" / "model.safetensors")
    expected = load_file(reference / "checkpoints" / "step-16" / "model.safetensors")
    assert final.keys() == expected.keys()
    for name in expected:
        assert final[name].equal(expected[name]), name
    steps = [r["step"] for r in records(interrupted) if "train/loss" in r]
    assert steps == list(range(1, 17)), "metrics after resume must continue without duplicates"
    tokens = {run: [r["train/tokens"] for r in records(run) if "train/loss" in r] for run in (reference, interrupted)}
    assert tokens[interrupted] == tokens[reference]  # a resumed run counts the tokens trained before it
    leftovers = [name for name in os.listdir(interrupted / "checkpoints") if ".partial-" in name or ".old-" in name]
    assert not leftovers, leftovers


def test_muon_orthogonalizes_the_hidden_matrices_and_leaves_the_head_to_adamw(tiny_target):
    """trainer.optimizer=muon: after one step from rest, a hidden matrix moved by an orthogonalized
    update (its leading singular values alike, where the gradient's span 50x) and the lm_head by
    AdamW's first step (every entry by lr)."""
    target, batch, vocab = distilled_setup(tiny_target)
    drafter = random_drafter("eagle3", target, vocab)
    optimizers = make_optimizers(compose_train(["target=tiny_llama", "trainer.optimizer=muon", "trainer.lr=1e-2"]), drafter)
    assert [type(o).__name__ for o in optimizers] == ["Muon", "AdamW"]
    assert optimizers[0].param_groups[0]["ns_steps"] == 5  # trainer.ns_steps: torch's default, unless set
    assert make_optimizers(compose_train(["target=tiny_llama", "trainer.optimizer=muon", "trainer.ns_steps=3"]),
                           drafter)[0].param_groups[0]["ns_steps"] == 3
    before = {name: weight.detach().clone() for name, weight in drafter.named_parameters()}
    drafter(batch, capture(target, vocab, batch, drafter.capture_layers()))[0].backward()
    for optimizer in optimizers:
        optimizer.step()
    moved = {name: weight.detach() - before[name] for name, weight in drafter.named_parameters()}
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"):
        update = torch.linalg.svdvals(moved[name])[:12]
        gradient = torch.linalg.svdvals(drafter.get_parameter(name).grad)[:12]
        assert update[0] / update[-1] < 1.5 and gradient[0] / gradient[-1] > 10, (name, update, gradient)
    head = moved["lm_head.weight"].abs()  # lr * |g| / (|g| + eps): lr but where a gradient is near eps
    assert ((head - 1e-2).abs() < 1e-4).float().mean() > 0.95


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_muon_orthogonalizes_in_float32_where_bf16_is_emulated(shape):
    """Muon(float32_orthogonalization=True), what make_optimizers builds where bf16 is not native:
    the step's update is torch's Newton-Schulz iteration (newton_schulz in bf16 is torch's, bit for bit)
    computed in float32, within 1e-5 of the same in float64, where torch's own bf16 update is off by
    more than 1e-3; after the step torch's function is its own again."""
    torch.manual_seed(0)
    gradient = torch.randn(shape)
    own = torch.optim._muon._zeropower_via_newtonschulz
    settings = ((3.4445, -4.775, 2.0315), 5, 1e-7)  # torch's defaults
    assert torch.equal(newton_schulz(gradient, *settings, dtype=torch.bfloat16), own(gradient, *settings))

    def update(float32: bool) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.zeros(shape))
        weight.grad = gradient.clone()
        Muon([weight], float32_orthogonalization=float32, lr=1.0, momentum=0.0, nesterov=False,
             adjust_lr_fn="original").step()  # no momentum: the update is -NS(gradient) x the shape's lr ratio
        return -weight.detach().double() / max(1.0, shape[0] / shape[1]) ** 0.5

    exact = newton_schulz(gradient.double(), *settings, dtype=torch.float64)
    assert (update(True) - exact).abs().max() < 1e-5
    assert (update(False) - exact).abs().max() > 1e-3
    assert torch.optim._muon._zeropower_via_newtonschulz is own


def test_the_full_presets_optimizer_is_muon_where_each_process_holds_whole_matrices_and_bf16_is_native():
    """trainer.optimizer=auto (trainer=full and long): Muon for one process and DDP, AdamW under ZeRO/FSDP
    (which flatten or shard the weights) and where bf16 is emulated; a checkpoint saved before the setting
    existed trained with AdamW."""
    assert optimizer_name(compose_train(["target=tiny_llama"])) == "adamw"  # the quick start's
    modes = ("none", "ddp", "zero2", "zero3", "fsdp")
    assert [optimizer_name(compose_train(["target=tiny_llama", "trainer=full", f"distributed={mode}"]))
            for mode in modes] == ["muon", "muon", "adamw", "adamw", "adamw"]
    assert {optimizer_name(compose_train(["target=tiny_llama", "trainer=full", f"distributed={mode}"]), native_bf16=False)
            for mode in modes} == {"adamw"}
    assert optimizer_name(compose_train(["target=tiny_llama", "distributed=zero2", "trainer.optimizer=muon"])) == "muon"
    assert optimizer_name({"trainer": {"lr": 1e-3}, "distributed": {"name": "none"}}) == "adamw"


def test_the_long_presets_regeneration_budget_is_longer_where_bf16_is_emulated():
    """data.regen.max_minutes=auto (trainer=long): 30 minutes where bf16 is native, 45 where it is emulated;
    a number given on the command line stays as given."""
    settled = []
    for native_bf16 in (True, False):
        cfg = compose_train(["target=tiny_llama", "trainer=long"])
        assert cfg.data.regen.max_minutes == "auto"
        settle_regen_minutes(cfg, native_bf16)
        settled.append(cfg.data.regen.max_minutes)
    assert settled == [30, 45]
    cfg = compose_train(["target=tiny_llama", "trainer=long", "data.regen.max_minutes=40"])
    settle_regen_minutes(cfg, native_bf16=False)
    assert cfg.data.regen.max_minutes == 40


def test_auto_settles_the_optimizer_for_this_machine_and_the_checkpoint_records_it(tmp_path):
    """trainer.optimizer=auto (one process): Muon where bf16 is native, AdamW where it is emulated, settled
    once and written into the run's config, so that a resume on another kind of machine compares the
    optimizer that trained, not `auto`."""
    result = train(tmp_path, "trainer.optimizer=auto", "trainer.max_steps=1", "logger=none", env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    settled = "muon" if precision.resolve("auto", "cpu").hardware.native_bf16 else "adamw"
    assert f"trainer.optimizer: {settled} (auto, distributed=none" in result.stderr + result.stdout
    state = json.loads((tmp_path / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert state["config"]["trainer"]["optimizer"] == settled


def test_a_muon_run_resumes_bitwise_and_refuses_another_optimizer(tmp_path):
    settings = ["trainer.optimizer=muon", "trainer.schedule=constant", "trainer.warmup_steps=0", "trainer.eval_every=100",
                "trainer.log_every=1", "logger=none"]
    one_thread = {"OMP_NUM_THREADS": "1"}
    assert train(tmp_path / "whole", *settings, "trainer.max_steps=4", env=one_thread).returncode == 0
    assert train(tmp_path / "cut", *settings, "trainer.max_steps=2", env=one_thread).returncode == 0
    assert {"optimizer.bin", "optimizer_1.bin"} <= set(os.listdir(tmp_path / "cut" / "checkpoints" / "step-2"))
    refused = train(tmp_path / "cut", *settings[1:], "trainer.optimizer=adamw", "trainer.max_steps=4", "trainer.resume=auto",
                    env=one_thread)
    one_line_error(refused, "trained with trainer.optimizer='muon', this run has trainer.optimizer='adamw'")
    resumed = train(tmp_path / "cut", *settings, "trainer.max_steps=4", "trainer.resume=auto", env=one_thread)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final, expected = (load_file(tmp_path / run / "checkpoints" / "step-4" / "model.safetensors") for run in ("cut", "whole"))
    assert all(final[name].equal(expected[name]) for name in expected)


def test_multirun_sweep(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "training.run", "-m", *TINY_RUN, "logger=none", "trainer.max_steps=1",
         "trainer.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        assert (tmp_path / job / "checkpoints" / "step-1" / "model.safetensors").exists()
    lrs = {json.loads((tmp_path / job / "checkpoints" / "step-1" / "trainer_state.json").read_text())["config"]["trainer"]["lr"]
           for job in ("0", "1")}
    assert lrs == {1e-3, 2e-3}


@pytest.mark.long
@pytest.mark.slow
def test_smollm2_few_steps_loss_goes_down(tmp_path):
    run_dir = tmp_path / "smol"
    result = subprocess.run(
        [sys.executable, "-m", "training.run", "target=llama", "logger=none", "data.max_samples=40",
         "data.max_length=256", "trainer.batch_size=2", "trainer.max_steps=12", "trainer.log_every=3",
         "trainer.eval_every=100", "trainer.eval_max_samples=4", "trainer.warmup_steps=2", "trainer.lr=2e-3",
         f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["train/loss"] for r in records(run_dir) if "train/loss" in r]
    assert len(losses) == 4
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", FAMILIES)
def test_metrics_are_detached_scalars_the_step_never_reads(name, tiny_target):
    """A training step reads no value off the device (on a GPU each read waits for it): every
    drafter's metrics are detached 0-dim tensors, summed on the device until the trainer logs."""
    target, batch, vocab = distilled_setup(tiny_target)
    drafter = random_drafter(name, target, vocab)
    loss, metrics = drafter.loss(batch, capture(target, vocab, batch, drafter.capture_layers()))
    assert loss.requires_grad and "acc/1" in metrics
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key


def test_length_grouped_batches_cover_each_epoch_with_far_less_padding():
    """`trainer.group_by_length`: every epoch still trains on each sequence once, in a seeded order
    of its own, and the batches pad far less than random ones; off, the order is the plain seeded
    permutation it always was (a run's batches, and so its losses, unchanged)."""
    from omegaconf import OmegaConf

    from training.trainer import BatchOrder

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 512, (1000,), generator=generator).tolist()

    def order(group, world=1, seed=0):
        cfg = OmegaConf.create({"seed": seed, "trainer": {"batch_size": 4, "grad_accum": 2, "group_by_length": group}})
        return BatchOrder(cfg, lengths, world)

    def padding(batches):
        micro = [batches.indices(step, m, rank) for step in range(125) for m in range(2) for rank in range(batches.world)]
        return sum(max(lengths[i] for i in b) * len(b) for b in micro) / sum(lengths[i] for b in micro for i in b)

    plain, grouped = order(False), order(True)
    assert plain.epoch(0) == torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    for batches in (plain, grouped, order(True, world=2)):
        assert sorted(batches.epoch(0)) == list(range(1000)) and sorted(batches.epoch(1)) == list(range(1000))
        assert batches.epoch(0) != batches.epoch(1)
    assert grouped.epoch(0) == order(True).epoch(0) != order(True, seed=1).epoch(0)
    assert padding(plain) > 1.3 and padding(grouped) < 1.05 and padding(order(True, world=2)) < 1.05
    assert grouped.tokens(3) == sum(lengths[i] for m in range(2) for i in grouped.indices(3, m, 0))
