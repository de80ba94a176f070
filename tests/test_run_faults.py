"""Faults around a training run and the files it owns (docs/errors.md): resuming without `latest`,
foreign files in checkpoints/, torn or stale metrics, two runs in one dir, a diverged head, full
disks, and an export aimed at the model it reads. Each case checks that what existed before is
byte-identical afterwards, or, where the run goes on, that it continued from the right checkpoint.
Each trains the tiny target in a process of its own: CI runs them after the suite (`-m long`)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from drafters.storage.artifact import read
from test_bad_input import TINY, snapshot, train_cli

pytestmark = pytest.mark.long
SAVES = ["trainer.save_every=2", "trainer.eval_every=2", "trainer.keep_last=3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("trained") / "run"
    result = train_cli(run, "trainer.max_steps=4", *SAVES)
    assert result.returncode == 0, result.stderr[-2000:]
    return run


def copy_of(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def logged_steps(run) -> list[int]:
    with open(run / "metrics.jsonl") as handle:
        return [json.loads(line)["step"] for line in handle if '"train/loss"' in line]


@pytest.mark.parametrize("latest", ["missing", "dangling"])
def test_resume_auto_without_latest_continues_the_newest_checkpoint(trained, tmp_path, latest):
    """Not a restart from step 0 over the checkpoints there: step-2 and step-4 stay as they were."""
    run = copy_of(trained, tmp_path)
    os.remove(run / "checkpoints" / "latest")
    if latest == "dangling":  # a user deleted the newest checkpoint it pointed at
        os.symlink("step-6", run / "checkpoints" / "latest")
    kept = {name: snapshot(run / "checkpoints" / name) for name in ("step-2", "step-4")}
    result = train_cli(run, "trainer.max_steps=6", "trainer.resume=auto", *SAVES)
    assert result.returncode == 0, result.stderr[-2000:]
    log = result.stdout + result.stderr
    assert f"resuming from the newest checkpoint, {run / 'checkpoints' / 'step-4'}" in log
    assert f"resumed from {run / 'checkpoints' / 'step-4'} at step 4" in log
    assert {name: snapshot(run / "checkpoints" / name) for name in kept} == kept
    assert os.readlink(run / "checkpoints" / "latest") == "step-6"
    assert logged_steps(run) == sorted(set(logged_steps(run))), "steps logged twice"


def test_foreign_entries_in_checkpoints_are_left_alone(trained, tmp_path):
    """Pruning and resuming read only step-N dirs that hold a checkpoint."""
    run = copy_of(trained, tmp_path)
    foreign = run / "checkpoints"
    (foreign / "step-old").mkdir()
    (foreign / "step-old" / "notes.txt").write_text("mine")
    (foreign / "step-3.bak").write_text("mine")
    (foreign / "README").write_text("mine")
    result = train_cli(run, "trainer.max_steps=8", "trainer.resume=auto", "trainer.save_every=2", "trainer.keep_last=1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(os.listdir(foreign)) == ["README", "latest", "step-3.bak", "step-8", "step-old"]
    assert (foreign / "step-old" / "notes.txt").read_text() == "mine"


def test_a_step_dir_that_is_not_a_checkpoint_is_never_replaced(trained, tmp_path):
    run = copy_of(trained, tmp_path)
    (run / "checkpoints" / "step-6").mkdir()
    (run / "checkpoints" / "step-6" / "notes.txt").write_text("mine")
    result = train_cli(run, "trainer.max_steps=6", "trainer.resume=auto", *SAVES)
    assert f"cannot write checkpoint {run / 'checkpoints' / 'step-6'}: something that is not a checkpoint" in error_line(result)
    assert (run / "checkpoints" / "step-6" / "notes.txt").read_text() == "mine"
    assert os.readlink(run / "checkpoints" / "latest") == "step-4"


def test_a_torn_metrics_line_does_not_stop_a_resume(trained, tmp_path):
    """A kill or a full disk mid-append leaves half a line: left out, the run resumes."""
    run = copy_of(trained, tmp_path)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "train/lo')
    result = train_cli(run, "trainer.max_steps=6", "trainer.resume=auto", *SAVES)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "line 5 is torn" in result.stdout + result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [2, 4, 6]


def test_a_dead_runs_metrics_are_not_mixed_into_a_fresh_one(tmp_path):
    """Killed before its first checkpoint: the rerun starts from step 0, so its curve starts clean."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 9.0}) + "\n" for s in (1, 2, 3)))
    result = train_cli(run, "trainer.max_steps=2", "trainer.resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(json.loads(line).get("train/loss") != 9.0 for line in (run / "metrics.jsonl").read_text().splitlines())


def test_a_resumed_run_logs_what_the_uninterrupted_one_logs(tmp_path):
    """A log window closes at every checkpoint, so a resume does not average a partial window (a
    constant schedule: the learning rate of a step does not depend on max_steps)."""
    common = ["trainer.log_every=3", "trainer.schedule=constant", *SAVES]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_cli(straight, "trainer.max_steps=6", *common).returncode == 0
    assert train_cli(resumed, "trainer.max_steps=4", *common).returncode == 0
    assert train_cli(resumed, "trainer.max_steps=6", "trainer.resume=auto", *common).returncode == 0

    def losses(run):
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], round(r["train/loss"], 5)) for r in records if "train/loss" in r]

    assert losses(resumed) == losses(straight)
    assert [step for step, _ in losses(straight)] == [2, 3, 4, 6]


def test_a_second_run_in_the_same_dir_is_refused_while_the_first_runs(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "training.run", *TINY, f"hydra.run.dir={run}", "trainer.max_steps=100000",
                              "trainer.save_every=100000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while '"pid"' not in ((run / ".specdraft.lock").read_text() if (run / ".specdraft.lock").exists() else ""):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        before = snapshot(run)
        second = train_cli(run, "trainer.max_steps=4", "seed=1", "trainer.resume=auto")
        assert f"hydra.run.dir {run} is in use by a run still going (pid {first.pid}" in error_line(second)
        launch = subprocess.run([sys.executable, "-m", "training.launch", *TINY, f"hydra.run.dir={run}", "launch.dry_run=true",
                                 "trainer.resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert "is in use by a run still going" in error_line(launch)
        still = ("metrics", "plots", "launch.log")  # what the first run goes on writing; Hydra's record of the launch
        assert {k: v for k, v in snapshot(run).items() if not k.startswith(still)} == \
            {k: v for k, v in before.items() if not k.startswith(still)}
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    after = train_cli(run, "trainer.max_steps=2", "trainer.resume=auto")  # the dead run holds nothing
    assert after.returncode == 0, after.stderr[-2000:]


def test_a_diverged_run_stops_before_saving_a_non_finite_checkpoint(tmp_path):
    run = tmp_path / "run"
    result = train_cli(run, "trainer.max_steps=20", "trainer.lr=1e9", *SAVES)
    assert "training diverged: train/loss is not finite by step" in error_line(result)
    for step in os.listdir(run / "checkpoints"):  # whatever was saved before it diverged: finite, and servable
        if step != "latest":
            read(str(run / "checkpoints" / step))


def test_export_never_writes_the_verifier_over_the_model_it_reads(trained, tmp_path):
    """A verifier dir export wrote, then used as a run's target: exporting that run's head with
    verifier_out= that dir must not replace the model being read, overwrite=true or not."""
    verifier = tmp_path / "verifier"
    export = [sys.executable, "-m", "export.run", "format=speculators", f"out={tmp_path / 'first'}",
              f"checkpoint={trained / 'checkpoints' / 'latest'}", f"verifier_out={verifier}"]
    assert subprocess.run(export, cwd=ROOT, capture_output=True, text=True, timeout=300).returncode == 0
    own = tmp_path / "own"
    result = train_cli(own, "target=hf", f"target.path={verifier}", "target.draft_vocab_size=512", "trainer.max_steps=1")
    assert result.returncode == 0, result.stderr[-2000:]
    before = snapshot(verifier)
    again = subprocess.run([sys.executable, "-m", "export.run", "format=speculators", f"out={tmp_path / 'second'}",
                            f"checkpoint={own / 'checkpoints' / 'latest'}", f"verifier_out={verifier}", "overwrite=true"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert f"verifier_out {verifier} would overwrite {verifier}" in error_line(again)
    assert snapshot(verifier) == before and not (tmp_path / "second").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs (root only; skipped where mounting is not allowed), filled by `fill(leave)`."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")

    def fill(leave_kib: int) -> None:
        free = shutil.disk_usage(disk).free // 1024
        filler = disk / f"filler-{len(os.listdir(disk))}"
        subprocess.run(["fallocate", "-l", f"{max(free - leave_kib, 1)}KiB", str(filler)], check=True)

    yield disk, fill
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(trained, small_disk):
    disk, fill = small_disk
    run = disk / "run"
    shutil.copytree(trained, run, symlinks=True)
    fill(4000)  # room for metrics and plots, not for a 15 MB checkpoint
    before = snapshot(run / "checkpoints")
    result = train_cli(run, "trainer.max_steps=6", "trainer.resume=auto", *SAVES)
    line = error_line(result)
    assert f"cannot write checkpoint {run / 'checkpoints' / 'step-6'}: no space left on the device" in line
    assert f"the last checkpoint, {run / 'checkpoints' / 'step-4'}, is intact" in line
    assert snapshot(run / "checkpoints") == before
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step-2", "step-4"], "a partial checkpoint was left"


def test_a_full_disk_during_an_export_or_a_benchmark_is_one_line(trained, small_disk):
    disk, fill = small_disk
    fill(4000)
    export = subprocess.run([sys.executable, "-m", "export.run", f"checkpoint={trained / 'checkpoints' / 'latest'}",
                             f"out={disk / 'artifact'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert f"out {disk / 'artifact'}: no space left on the device" in error_line(export)
    fill(1)
    bench = subprocess.run([sys.executable, "-m", "serving.bench", f"artifact={trained / 'checkpoints' / 'latest'}", "n=1",
                            "max_new_tokens=4", f"out={disk / 'b.json'}", f"hydra.run.dir={trained.parent}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert f"{disk / 'b.json'}: no space left on the device" in error_line(bench)
    assert all(name.startswith("filler-") for name in os.listdir(disk)), "a partial file or directory was left"
