"""precision=auto: the resolver on every branch, what a run records, a head crossing dtypes, and
the time budget that settles the quick start's length."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import PROMPTS, VARIED_TARGET, chat_ids, self_distilled_batch
from drafters.base import Captured, capture
from drafters.config.errors import UserError
from drafters.storage import artifact
from drafters.target import precision
from drafters.target.precision import Hardware, choose, cpu_hardware, gpu_support
from serving.engine import compare, generate_plain, generate_spec
from training import schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch's kernels capped at AVX2 (ATen dispatch and oneDNN): on a CPU with AVX512-BF16 this is an
# AVX2-only machine as far as torch computes (a bf16 matmul measured ~40-70x slower than fp32); on an
# AVX2-only CPU it changes nothing
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
X86_AVX2 = {"architecture": "x86_64", "avx2": True, "cpu_name": "AMD EPYC"}
X86_BF16 = {**X86_AVX2, "avx512_f": True, "avx512_bf16": True}


def never_measured() -> float:
    raise AssertionError("what torch reports settles it: no benchmark should run")


def gpu(native_bf16: bool, native_fp16: bool) -> Hardware:
    return Hardware("cuda", "a GPU", "sm_xx", native_bf16, native_fp16, "reported by torch", 8)


def test_cpu_without_bf16_instructions_is_float32():
    hardware = cpu_hardware(X86_AVX2, "AVX2", False, never_measured)
    assert not hardware.native_bf16 and choose("auto", hardware) == torch.float32
    assert "no native bf16" in hardware.describe()


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_cpu_with_native_bf16_is_bfloat16(flag):
    hardware = cpu_hardware({**X86_AVX2, "avx512_f": True, flag: True}, "AVX512", False, never_measured)
    assert hardware.native_bf16 and choose("auto", hardware) == torch.bfloat16


@pytest.mark.parametrize("caps, dispatch, capped", [
    (X86_BF16, "AVX2", False),  # the CPU has AVX512-BF16, torch's kernels run at AVX2
    (X86_BF16, "AVX512", True),  # oneDNN capped below it
    ({"architecture": "aarch64", "bf16": True, "cpu_name": "Neoverse"}, "SVE256", False),  # ARM: measure
])
def test_ambiguous_reports_are_settled_by_a_benchmark(caps, dispatch, capped):
    slow = cpu_hardware(caps, dispatch, capped, lambda: 40.0)
    assert not slow.native_bf16 and choose("auto", slow) == torch.float32 and "measured 40x" in slow.evidence
    fast = cpu_hardware(caps, dispatch, capped, lambda: 0.5)
    assert fast.native_bf16 and choose("auto", fast) == torch.bfloat16


@pytest.mark.parametrize("major, minor, rocm, expected", [
    (9, 0, False, torch.bfloat16),  # H100 / H200
    (8, 0, False, torch.bfloat16),  # A100
    (7, 0, False, torch.float16),  # V100: fp16 tensor cores, no bf16
    (6, 0, False, torch.float16),  # P100: fast fp16
    (6, 1, False, torch.float32),  # consumer Pascal: neither
    (9, 4, True, torch.bfloat16),  # MI300X (gfx942)
])
def test_gpu_choice(major, minor, rocm, expected):
    assert choose("auto", gpu(*gpu_support(major, minor, rocm))) == expected


def test_explicit_values_win():
    slow_cpu = cpu_hardware(X86_AVX2, "AVX2", False, never_measured)
    assert choose("bf16", slow_cpu) == torch.bfloat16
    assert choose("fp32", gpu(True, True)) == torch.float32
    assert precision.resolve("float32").dtype == precision.resolve("fp32").dtype == torch.float32
    with pytest.raises(UserError, match="trainer.precision=bf17: unknown precision"):
        precision.resolve("bf17", key="trainer.precision")


def test_capabilities_without_get_capabilities():
    """A torch without torch.cpu.get_capabilities: the same bf16 verdict from its older flags."""
    theirs = dict(precision.cpu_capabilities())
    ours = precision.cpu_capabilities(get=None)
    assert ours["architecture"] == theirs["architecture"]
    dispatch = torch.backends.cpu.get_cpu_capability()
    assert cpu_hardware(ours, dispatch, False, lambda: 1.0).native_bf16 == cpu_hardware(theirs, dispatch, False,
                                                                                          lambda: 1.0).native_bf16


def test_this_machine_is_probed_for_what_it_computes():
    """The real probe against the real hardware: when it calls bf16 native, a bf16 matmul is no
    slower than a few times fp32; when it does not, it is many times slower or never reported."""
    hardware = precision.probe("cpu")
    slowdown = precision.matmul_slowdown(torch.bfloat16, repeats=5)
    if hardware.native_bf16:
        assert slowdown < 3, (hardware, slowdown)
    else:
        assert slowdown > 3 or "no bf16 instructions" in hardware.evidence, (hardware, slowdown)


def python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_avx2_only_resolves_float32_and_warns_once_for_explicit_bf16():
    code = ("import logging; logging.basicConfig(); from drafters.target import precision; "
            "print(precision.resolve('auto').name); precision.resolve('bf16'); precision.resolve('bf16')")
    result = python(code, AVX2_ONLY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["float32"]
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "no native bfloat16" in warnings[0] and "slower than in float32" in warnings[0]


TINY_RUN = ["target=tiny_llama", "logger=none", "data.max_samples=40", "data.max_length=128", "trainer.batch_size=2",
            "trainer.eval_max_samples=4", "trainer.warmup_steps=2"]


def train(run_dir, *overrides, env=None):
    return subprocess.run([sys.executable, "-m", "training.run", *TINY_RUN, f"hydra.run.dir={run_dir}", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_default_run_without_native_bf16_trains_and_records_float32(tmp_path):
    result = train(tmp_path / "run", "target.dtype=auto", "trainer.max_steps=2", env=AVX2_ONLY)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "run" / "run.log").read_text()
    assert "precision: float32 (auto) for the target and the drafter; CPU AVX2: no native bf16" in log
    config = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert (config.target.dtype, config.trainer.precision) == ("float32", "float32")
    state = json.loads((tmp_path / "run" / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert state["precision"]["target"] == state["precision"]["autocast"] == "float32"
    assert state["precision"]["hardware"]["capability"] == "AVX2" and not state["precision"]["hardware"]["native_bf16"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A checkpoint trained in each precision on the varied tiny target."""
    made = {}
    for dtype in ("float32", "bfloat16"):
        run_dir = tmp_path_factory.mktemp(f"trained-{dtype}")
        result = train(run_dir, *VARIED_TARGET, f"target.dtype={dtype}", f"trainer.precision={dtype}",
                       "trainer.max_steps=4", "trainer.lr=3e-3")
        assert result.returncode == 0, result.stderr[-3000:]
        made[dtype] = str(run_dir / "checkpoints" / "latest")
    return made


def serve(checkpoint: str, dtype: str) -> dict:
    """{prompt: (plain greedy tokens, speculative tokens, plain top-2 margins)} with the target and
    head computing in `dtype`."""
    target, drafter = artifact.load(checkpoint, dtype=dtype)
    assert {p.dtype for p in drafter.parameters() if p.is_floating_point()} == {target.embed_weight.dtype}
    assert target.embed_weight.dtype == precision.NAMES[dtype]
    out = {}
    for text in PROMPTS:
        ids = chat_ids(target, text)
        plain, plain_stats = generate_plain(target, ids, 24, set())
        spec, _ = generate_spec(target, drafter, ids, 24, set(), steps=4)
        out[text] = (plain, spec, plain_stats.margins)
    return out


@pytest.mark.parametrize("trained_in", ["float32", "bfloat16"])
def test_a_head_serves_in_either_precision(heads, trained_in):
    """Checkpoints are dtype-independent: a head trained in one precision serves losslessly in
    either (float32: token for token; bf16: but for top-2 ties one bf16 step apart, 2^-4 for this
    target's logits in [8, 16)), and computes the same in both: on the same target states its loss
    agrees to bf16 rounding.

    (Its bf16 and float32 *outputs* are the target's greedy tokens in that precision; this random
    target, with weights 15x larger than a trained model's, amplifies bf16 rounding until they part
    at gaps of several bf16 steps, which says nothing about the head.)"""
    state = json.loads(open(os.path.join(heads[trained_in], "trainer_state.json")).read())
    assert state["precision"]["autocast"] == trained_in
    for dtype in ("float32", "bfloat16"):
        for text, (plain, spec, margins) in serve(heads[trained_in], dtype).items():
            assert compare(plain, spec, margins, dtype == "float32", tolerance=2**-4)[0] != "unexplained", (dtype, text)

    target, head32 = artifact.load(heads[trained_in], dtype="float32")
    _, head16 = artifact.load(heads[trained_in], target=target, dtype="float32")
    head16 = head16.to(torch.bfloat16)
    batch = self_distilled_batch(target)
    captured = capture(target, artifact.read(heads[trained_in]).vocab(), batch, head32.capture_layers())
    as_bf16 = Captured(**{name: value.to(torch.bfloat16) if value.is_floating_point() else value
                          for name, value in vars(captured).items() if not isinstance(value, list)},
                       aux=[state.to(torch.bfloat16) for state in captured.aux])
    with torch.no_grad():
        loss32, _ = head32.loss(batch, captured)
        loss16, _ = head16.loss(batch, as_bf16)
    # (not acc/k: a head this briefly trained has near-uniform logits, whose argmax any rounding flips)
    assert float(loss16) == pytest.approx(float(loss32), rel=1e-2)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def budget_for(monkeypatch, minutes, max_steps=100, warmup=2, rate=None, start_step=0, doubling=False, deadline=None,
               spent=0.0):
    """A TimeBudget on a fake clock; `spent`: the seconds this process ran before it (regeneration, dump)."""
    clock = Clock()
    monkeypatch.setattr(schedule.time, "perf_counter", clock)
    monkeypatch.setattr(schedule, "process_seconds", lambda: spent)
    cfg = OmegaConf.create({"trainer": {"max_minutes": minutes, "deadline_minutes": deadline, "max_steps": max_steps,
                                        "warmup_steps": warmup,
                                        "eval_every": 50, "eval_doubling": doubling, "eval_max_samples": 8, "batch_size": 4,
                                        "schedule": "cosine", "min_lr_ratio": 0.1}})
    rate = rate or schedule.LearningRate(warmup, max_steps, 0.1, True)
    return schedule.TimeBudget(cfg, SimpleNamespace(num_processes=1), rate, start_step), rate, clock


def warmed_up(monkeypatch):
    """A 5-minute budget after its 2 warm-up steps: 10 s a step, the first with 5 s of one-off start-up."""
    budget, rate, clock = budget_for(monkeypatch, minutes=5)
    for step, now in ((1, 15.0), (2, 25.0)):
        clock.now = now
        budget.after_step(step)
    return budget, rate, clock


def test_time_budget_settles_the_length_at_the_end_of_warmup(monkeypatch):
    budget, rate, clock = warmed_up(monkeypatch)
    # 275 s left at 10 s a step, with one final evaluation of 2 batches x 10 s x EVAL_BATCH_SHARE
    assert rate.total == 2 + int((275 - 2 * 10 * schedule.EVAL_BATCH_SHARE) // 10)
    settled = rate.total
    assert rate(settled) == pytest.approx(0.1)  # the cosine reaches its floor at the settled end
    for step in range(3, settled):
        clock.now += 10.0
        budget.after_step(step)
    assert rate.total == settled


def test_the_budget_clock_starts_with_the_loop_not_with_the_dump_before_it(monkeypatch):
    """A cached run writes its hidden-state cache after the budget is made: those minutes are not training's."""
    budget, rate, clock = budget_for(monkeypatch, minutes=5)
    clock.now = 600.0  # a 10-minute dump: twice the whole budget
    budget.start()
    for step, now in ((1, 615.0), (2, 625.0)):
        clock.now = now
        budget.after_step(step)
    assert rate.total == warmed_up(monkeypatch)[1].total > 2


@pytest.mark.parametrize("minutes, deadline, spent, like", [
    (None, 12, 420.0, 4.5),  # 7 of the deadline's 12 minutes went to regeneration and the dump, 0.5 to loading
    (None, 12, 300.0, 6.5),
    (5, 60, 420.0, 5),  # the deadline leaves more than max_minutes: max_minutes
])
def test_a_deadline_leaves_training_what_the_work_before_it_did_not_spend(monkeypatch, minutes, deadline, spent, like):
    """Trains as long as a plain budget of `like` minutes would."""
    budget, rate, clock = budget_for(monkeypatch, minutes=minutes, deadline=deadline, spent=spent, max_steps=1000)
    clock.now = 30.0  # loading, after the budget was made: the deadline's minutes too
    budget.start()
    for step, now in ((1, 45.0), (2, 55.0)):
        clock.now = now
        budget.after_step(step)
    alike, alike_rate, alike_clock = budget_for(monkeypatch, minutes=like, max_steps=1000)
    for step, now in ((1, 15.0), (2, 25.0)):
        alike_clock.now = now
        alike.after_step(step)
    assert rate.total == alike_rate.total > 2


def test_a_deadline_already_spent_ends_the_run_after_its_warmup(monkeypatch):
    budget, rate, clock = budget_for(monkeypatch, minutes=None, deadline=10, spent=700.0, max_steps=1000)
    budget.start()
    for step, now in ((1, 15.0), (2, 25.0)):
        clock.now = now
        budget.after_step(step)
    assert rate.total == 2


def test_time_budget_stops_a_run_that_falls_behind(monkeypatch):
    budget, rate, clock = warmed_up(monkeypatch)
    settled = rate.total
    step = 2
    while step < rate.total:  # steps take 4x longer than measured from here on
        step += 1
        clock.now += 40.0
        budget.after_step(step)
    assert step < settled and clock.now <= 300.0 + 40.0


def test_a_measured_evaluation_replans_the_run(monkeypatch):
    """An evaluation that measures real acceptance costs far more than the estimate: once one has
    run, its time re-plans the steps left (evaluations every 50 steps and one at the end included)."""
    budget, rate, clock = budget_for(monkeypatch, minutes=20, max_steps=1000)
    for step, now in ((1, 15.0), (2, 25.0)):
        clock.now = now
        budget.after_step(step)
    settled = rate.total
    for step in range(3, 51):
        clock.now += 10.0
        budget.after_step(step)
    clock.now += 60.0  # the evaluation at step 50: 60 s, where 7 s were estimated
    budget.after_eval(50, 60.0)
    assert rate.total < settled and rate.budgeted

    def rest(total):  # the steps after 50 and the evaluations at 100, 150, ... and at the end
        return (total - 50) * 10.0 + (total // 50 - 1 + 1) * 60.0

    left = 1200.0 - clock.now
    assert rest(rate.total) <= left < rest(rate.total + 1)
    replanned = rate.total
    budget.after_eval(replanned, 60.0)  # the final one changes nothing
    assert rate.total == replanned


def test_a_run_whose_steps_speed_up_after_the_warmup_grows_without_waiting_for_an_evaluation(monkeypatch):
    """Measured on an H200: 0.50 s a step over the warm-up, 0.06 s after it, so a budget settled at the
    end of the warm-up ran 1:45 of its 3 minutes. Re-planned every warm-up's length of steps, the run
    grows as soon as the steps are fast, and ends within its budget, using nearly all of it."""
    budget, rate, clock = budget_for(monkeypatch, minutes=5, max_steps=100_000, warmup=10)
    clock.now, step = 15.0, 1  # the first step, with its one-off start-up
    budget.after_step(step)
    while step < rate.total:
        step += 1
        clock.now += 4.0 if step <= 10 else 0.5
        budget.after_step(step)
        if step == 10:
            settled = rate.total
    assert rate.total == step > 5 * settled
    assert 0.95 * 300.0 < clock.now <= 300.0


def test_doubling_evaluations_come_at_eval_every_times_powers_of_two_and_leave_more_steps(monkeypatch):
    doubling, every = (OmegaConf.create({"eval_every": 25, "eval_doubling": d}) for d in (True, False))
    assert [step for step in range(1, 1000) if schedule.eval_due(step, doubling)] == [25, 50, 100, 200, 400, 800]
    assert [step for step in range(1, 101) if schedule.eval_due(step, every)] == [25, 50, 75, 100]
    totals = {}
    for kind in (True, False):  # a one-hour run at 10 s a step whose evaluation at step 50 took 60 s
        budget, rate, clock = budget_for(monkeypatch, minutes=60, max_steps=1000, doubling=kind)
        for step in range(1, 51):
            clock.now = 5.0 + 10.0 * step
            budget.after_step(step)
        clock.now += 60.0
        budget.after_eval(50, 60.0)
        totals[kind] = rate.total
    # the most steps whose time and evaluations (those due after step 50, and the final one) fit in what is left
    for kind, due in ((False, lambda step: step % 50 == 0), (True, lambda step: step in (100, 200, 400, 800))):
        cost = lambda total: (total - 50) * 10.0 + (1 + sum(map(due, range(51, total + 1)))) * 60.0  # noqa: E731
        assert cost(totals[kind]) <= 3600.0 - 565.0 < cost(totals[kind] + 1)
    assert totals[True] > totals[False]


def test_a_run_slowed_by_a_busy_spell_grows_back_once_steps_are_fast_again(monkeypatch):
    """Re-planning after each evaluation uses the steps timed since the previous one: a run whose
    steps took 3x longer for a while (another job on the machine) is shortened, then lengthened
    again once they are fast, and the rest always fits in what is left."""
    budget, rate, clock = budget_for(monkeypatch, minutes=60, max_steps=1000)
    for step, now in ((1, 15.0), (2, 25.0)):
        clock.now = now
        budget.after_step(step)
    settled = rate.total
    lengths, mark = [], (2, 25.0)  # step times are measured from the end of the warm-up
    for seconds, steps in ((30.0, range(3, 51)), (10.0, range(51, 101))):  # busy, then quiet
        for step in steps:
            clock.now += seconds
            budget.after_step(step)
        measured = (clock.now - mark[1]) / (step - mark[0])
        clock.now += 7.0
        budget.after_eval(step, 7.0)
        mark = (step, clock.now)
        lengths.append(rate.total)
        rest = (rate.total - step) * measured + (rate.total // 50 - step // 50 + 1) * 7.0
        assert rest <= 3600.0 - clock.now < rest + measured
    assert lengths[0] < settled and lengths[1] > lengths[0]


def test_a_resumed_run_keeps_its_budgeted_length_or_takes_a_new_max_steps(monkeypatch):
    _, rate, _ = warmed_up(monkeypatch)
    settled = rate.total
    assert settled < 100 and rate.budgeted
    restored = schedule.LearningRate(2, 100, 0.1, True)
    vars(restored).update(vars(rate))  # what the scheduler's state brings back on resume
    _, resumed, _ = budget_for(monkeypatch, minutes=5, max_steps=400, rate=restored, start_step=10)
    assert resumed.total == settled  # the budget's cut stands
    again = schedule.LearningRate(2, 100, 0.1, True)
    vars(again).update(vars(rate))
    _, by_deadline, _ = budget_for(monkeypatch, minutes=None, deadline=120, max_steps=400, rate=again, start_step=10)
    assert by_deadline.total == settled  # under a deadline alone too
    unbudgeted = schedule.LearningRate(2, 2, 0.1, True)  # a finished 2-step run, extended to 4
    _, extended, _ = budget_for(monkeypatch, minutes=5, max_steps=4, rate=unbudgeted, start_step=2)
    assert extended.total == 4


@pytest.mark.parametrize("minutes", [0, -1, "abc", True])
def test_a_budget_that_is_no_positive_number_is_one_clear_error(monkeypatch, minutes):
    with pytest.raises(UserError, match=f"trainer.max_minutes={minutes}: give a number of minutes > 0"):
        budget_for(monkeypatch, minutes=minutes)


def test_time_budget_never_exceeds_max_steps_and_off_is_max_steps(monkeypatch):
    budget, rate, clock = budget_for(monkeypatch, minutes=60, max_steps=20)
    for step in (1, 2):
        clock.now += 1.0
        budget.after_step(step)
    assert rate.total == 20
    _, rate, _ = budget_for(monkeypatch, minutes=None, max_steps=30)
    assert rate.total == 30


def test_learning_rate_matches_transformers_schedules():
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    def rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = make(optimizer)
        return [scheduler.lr_lambdas[0](step) for step in range(40)]

    ours = schedule.LearningRate(5, 37, 0.1, cosine=True)
    assert [ours(step) for step in range(40)] == rates(
        lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 5, 37, min_lr_rate=0.1))
    constant = schedule.LearningRate(5, 37, 0.1, cosine=False)
    assert [constant(step) for step in range(40)] == rates(lambda o: get_constant_schedule_with_warmup(o, 5))


def test_a_short_budget_ends_the_run_early_with_its_eval_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = train(run_dir, "trainer.max_steps=100000", "trainer.max_minutes=0.1", "trainer.eval_every=100000",
                   "trainer.save_every=100000")
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((run_dir / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert 2 <= state["step"] < 100000
    assert "time budget 0.1 min" in (run_dir / "run.log").read_text()
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == state["step"] and "eval/sim_accept_len" in evals[-1]


def test_a_deadline_counts_the_minutes_before_training(tmp_path):
    """The process's start-up, data and target loading spend the deadline too: the loop gets the rest."""
    run_dir = tmp_path / "run"
    result = train(run_dir, "trainer.max_steps=100000", "trainer.max_minutes=null", "trainer.deadline_minutes=0.4",
                   "trainer.eval_every=100000", "trainer.save_every=100000")
    assert result.returncode == 0, result.stderr[-3000:]
    left = float(re.search(r"deadline 0.4 min: ([\d.]+) min of it left", (run_dir / "run.log").read_text())[1])
    assert 0 <= left < 0.4
    assert 2 <= json.loads((run_dir / "checkpoints" / "latest" / "trainer_state.json").read_text())["step"] < 100000
