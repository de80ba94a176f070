"""End-to-end runs of `python -m training.run` on the tiny random target (and one on SmolLM2)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["target=tiny_llama", "data.max_samples=60", "data.max_length=160", "trainer.batch_size=2",
        "trainer.eval_max_samples=8", "trainer.warmup_steps=2"]


def command(run_dir, *overrides):
    return [sys.executable, "-m", "training.run", *TINY, f"hydra.run.dir={run_dir}", *overrides]


def train(run_dir, *overrides, env=None, timeout=300):
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def test_run_dir_layout_metrics_plots_and_wandb(tmp_path):
    run_dir = tmp_path / "run"
    result = train(run_dir, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=2", "trainer.log_every=1",
                   "logger=wandb", f"cache_dir={tmp_path / 'cache'}", "trainer.eval_accept_prompts=2",
                   "trainer.eval_accept_tokens=8")
    assert result.returncode == 0, result.stderr[-3000:]
    logged = records(run_dir)
    assert [r["step"] for r in logged if "train/loss" in r] == [1, 2, 3, 4]
    train_keys = set(logged[0])
    assert {"train/loss", "perf/tokens_per_s", *(f"train/acc/{k}" for k in range(1, 8))} <= train_keys
    evals = [r for r in logged if "eval/sim_accept_len" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"eval/loss", "eval/vocab_coverage", *(f"eval/acc/{k}" for k in range(1, 8))} <= set(evals[0])
    assert evals[-1]["eval/sim_accept_len"] >= 1.0
    assert 1.0 <= evals[-1]["eval/accept_len"] <= 8.0  # measured by the serving engine
    assert sorted(os.listdir(run_dir / "plots")) == ["acceptance_by_position.png", "loss.png", "sim_accept_len.png"]
    assert os.path.realpath(run_dir / "checkpoints" / "latest") == str(run_dir / "checkpoints" / "step-4")
    state = json.loads((run_dir / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["drafter"] == "eagle3" and state["target"] == "tiny-llama"
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline_runs, "W&B offline run missing"
    assert "final eval/sim_accept_len" in result.stderr + result.stdout


def test_resume_after_sigkill_is_bitwise_identical(tmp_path):
    settings = ["trainer.max_steps=24", "trainer.save_every=4", "trainer.eval_every=100", "trainer.log_every=1",
                "logger=none", "trainer.keep_last=10"]
    reference = tmp_path / "reference"
    assert train(reference, *settings).returncode == 0

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(command(interrupted, *settings), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    latest = interrupted / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if os.path.exists(latest) and os.path.realpath(latest).endswith(("step-8", "step-12")):
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = int(os.path.realpath(latest).rsplit("-", 1)[1])
    assert killed_at < 24

    result = train(interrupted, *settings, "trainer.resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    final = load_file(interrupted / "checkpoints" / "step-24" / "model.safetensors")
    expected = load_file(reference / "checkpoints" / "step-24" / "model.safetensors")
    assert final.keys() == expected.keys()
    for name in expected:
        assert final[name].equal(expected[name]), name
    steps = [r["step"] for r in records(interrupted) if "train/loss" in r]
    assert steps == list(range(1, 25)), "metrics after resume must continue without duplicates"


def test_multirun_sweep(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "training.run", "-m", *TINY, "logger=none", "trainer.max_steps=1",
         "trainer.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        assert (tmp_path / job / "checkpoints" / "step-1" / "model.safetensors").exists()
    lrs = {json.loads((tmp_path / job / "checkpoints" / "step-1" / "trainer_state.json").read_text())["config"]["trainer"]["lr"]
           for job in ("0", "1")}
    assert lrs == {1e-3, 2e-3}


def one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_bad_inputs_give_one_clear_line(tmp_path):
    quick = ["logger=none", "trainer.max_steps=1"]
    one_line_error(train(tmp_path / "a", *quick, f"data.path={tmp_path / 'missing.jsonl'}"), "missing.jsonl")

    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    bad.write_text(good + "\n" + good + "\n{not json\n")
    one_line_error(train(tmp_path / "b", *quick, f"data.path={bad}"), "bad.jsonl:3")

    one_line_error(train(tmp_path / "c", *quick, "drafter.aux_layers=[1,2,40]"), "out of range")

    not_lm = tmp_path / "not_a_model"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 8}))
    one_line_error(train(tmp_path / "d", *quick, "target=hf", f"target.path={not_lm}"), "not a causal LM")


def test_resume_refuses_other_target(tmp_path):
    run_dir = tmp_path / "run"
    assert train(run_dir, "logger=none", "trainer.max_steps=1").returncode == 0
    other = train(tmp_path / "other", "logger=none", "trainer.max_steps=2", "target.random_init.seed=7",
                  f"trainer.resume={run_dir / 'checkpoints' / 'latest'}")
    line = one_line_error(other, "cannot resume")
    assert "target_fingerprint" in line
    assert (run_dir / "checkpoints" / "step-1" / "model.safetensors").exists(), "the checkpoint must survive"


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
