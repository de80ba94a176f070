"""How a run trains and for how long: its optimizers, the learning-rate schedule over its steps,
and the time budget (`trainer.max_minutes`, `trainer.deadline_minutes`) that settles the number of
steps from the measured step time."""

from __future__ import annotations

import logging
import math
import time

import psutil
import torch
from accelerate.utils import broadcast_object_list
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LambdaLR

from drafters.config.errors import UserError
from drafters.target import precision
from training.distributed import WHOLE_WEIGHTS

log = logging.getLogger("training")

# An evaluation batch (target forward + drafter forward, no backward) costs about a third of a
# training step (measured on the quick start, SmolLM2: 0.31 in bf16 on AVX512-BF16, 0.33 in fp32 on AVX2)
EVAL_BATCH_SHARE = 0.35
# The run's length is settled from the steps after the first one (whose time includes one-off
# kernel selection and allocation), at the end of the warm-up, so no step has run at a learning rate
# that the settled length would have changed
MIN_TIMED_STEPS = 2
# weights Muon leaves to AdamW besides vectors: embeddings, output heads, DSpark's vocabulary factors
NOT_FOR_MUON = ("embed", "lm_head", "markov")


class LearningRate:
    """The learning-rate multiplier at optimizer step `step`: linear warm-up, then cosine decay to
    `min_ratio` at step `total` (transformers' cosine-with-min-lr formula), or constant. An object,
    not a closure, so that `total` is saved and restored with the scheduler's state."""

    def __init__(self, warmup: int, total: int, min_ratio: float, cosine: bool):
        self.warmup, self.total, self.min_ratio, self.cosine = warmup, total, min_ratio, cosine
        self.budgeted = False  # total was cut to what a time budget allows

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return float(step) / float(max(1, self.warmup))
        if not self.cosine:
            return 1.0
        progress = float(step - self.warmup) / float(max(1, self.total - self.warmup))
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, factor * (1 - self.min_ratio) + self.min_ratio)


def eval_due(step: int, trainer: DictConfig) -> bool:
    """Whether an evaluation follows step `step`: every `eval_every` steps, or with `eval_doubling` at
    eval_every, 2x, 4x, ... steps (a learning curve's points evenly spaced on its log axis, at a
    fraction of the evaluations' cost)."""
    periods, due = divmod(step, trainer.eval_every)
    return due == 0 and periods > 0 and (not trainer.eval_doubling or periods & (periods - 1) == 0)


def optimizer_name(config: DictConfig | dict, native_bf16: bool = True) -> str:
    """A run's `trainer.optimizer` (its config, or the one a checkpoint saved: none before Muon came,
    so AdamW), with `auto` settled: Muon where every process holds whole weight matrices (one process,
    DDP) and bf16 is native; AdamW where ZeRO/FSDP flatten or shard them (distributed.check_mode refuses
    an explicit muon there) or where bf16 is emulated (AVX2-only CPUs: Muon's float32 orthogonalization
    is a large share of a step there, and AdamW's extra steps led at equal wall clock, docs/results.md).
    The trainer writes the settled name into the run's config, so a checkpoint records what trained
    it; one saved with `auto` (before 2026-12-06) trained with Muon wherever the weights were whole."""
    chosen = config.get("trainer", {}).get("optimizer", "adamw")
    if chosen != "auto":
        return chosen
    whole = config.get("distributed", {}).get("name", "none") in WHOLE_WEIGHTS
    return "muon" if whole and native_bf16 else "adamw"


def newton_schulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch's Muon orthogonalization (the same quintic Newton-Schulz iteration, op for op) in `dtype`."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.to(dtype).T if tall else grad.to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch's Muon, whose Newton-Schulz iteration runs in bf16 whatever the hardware; with
    `float32_orthogonalization` (where bf16 is emulated: AVX2-only CPUs) it runs in float32, as the
    one function torch's step calls for it (an emulated bf16 iteration costs many steps' time:
    docs/results.md)."""

    def __init__(self, params, *, float32_orthogonalization: bool, **options):
        super().__init__(params, **options)
        self.float32_orthogonalization = float32_orthogonalization

    def step(self, closure=None):
        if not self.float32_orthogonalization:
            return super().step(closure)
        bf16 = torch.optim._muon._zeropower_via_newtonschulz
        torch.optim._muon._zeropower_via_newtonschulz = newton_schulz  # float32 by default
        try:
            return super().step(closure)
        finally:
            torch.optim._muon._zeropower_via_newtonschulz = bf16


def make_optimizers(cfg: DictConfig, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """`adamw` (optimizer_name): AdamW over every trainable weight. `muon`: Muon over the hidden
    matrices and AdamW over the rest (speculators' default split: Muon orthogonalizes matrix updates,
    which suits neither vocabulary-indexed rows nor vectors), both at `trainer.lr` (Muon's update
    scaled to AdamW's RMS); its orthogonalization in bf16 where the hardware computes bf16, else float32."""
    trainer = cfg.trainer
    named = [(name, weight) for name, weight in model.named_parameters() if weight.requires_grad]
    if optimizer_name(cfg) == "adamw":
        log.info("optimizer adamw: %.2fM weights", sum(w.numel() for _, w in named) / 1e6)
        return [torch.optim.AdamW([weight for _, weight in named], lr=trainer.lr, weight_decay=trainer.weight_decay)]
    muon = [weight for name, weight in named
            if weight.ndim == 2 and min(weight.shape) > 1 and not any(part in name for part in NOT_FOR_MUON)]
    rest = [weight for _, weight in named if all(weight is not matrix for matrix in muon)]
    float32 = bool(muon) and not precision.resolve("auto", muon[0].device).hardware.native_bf16
    log.info("optimizer muon: %.2fM weights in %d matrices with Muon (%d Newton-Schulz steps in %s), %.2fM with AdamW",
             sum(w.numel() for w in muon) / 1e6, len(muon), trainer.ns_steps, "float32: no native bf16" if float32 else "bf16",
             sum(w.numel() for w in rest) / 1e6)
    return ([Muon(muon, float32_orthogonalization=float32, lr=trainer.lr, weight_decay=trainer.weight_decay,
                  ns_steps=trainer.ns_steps, adjust_lr_fn="match_rms_adamw")] if muon else []) + \
        ([torch.optim.AdamW(rest, lr=trainer.lr, weight_decay=trainer.weight_decay)] if rest else [])


def make_schedule(cfg: DictConfig, optimizers: list[torch.optim.Optimizer]) -> tuple[list[LambdaLR], LearningRate]:
    """One schedule per optimizer, all following the same `LearningRate`."""
    rate = LearningRate(cfg.trainer.warmup_steps, cfg.trainer.max_steps, cfg.trainer.min_lr_ratio,
                        cfg.trainer.schedule == "cosine")
    return [LambdaLR(optimizer, rate) for optimizer in optimizers], rate


def process_seconds() -> float:
    """How long this process has run: what regeneration, the dump and loading spent before training."""
    return time.time() - psutil.Process().create_time()


def minutes_setting(cfg: DictConfig, key: str) -> float | None:
    minutes = cfg.trainer.get(key)
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0):
        raise UserError(f"trainer.{key}={minutes}: give a number of minutes > 0, or null for no budget")
    return None if minutes is None else float(minutes)


class TimeBudget:
    """`trainer.max_minutes` of wall time for the training loop (evaluations and checkpoints
    included; the clock starts with the loop, at `start`, so a cached run's dump is not in it), and at
    most what `trainer.deadline_minutes`, counted from the start of the process (regeneration, the
    dump and loading included), leaves it: a preset that must end within a wall clock trains longer
    where its data came faster. At the end of the warm-up the run's length becomes the steps that
    fit in what is left at the measured step time (never more than `max_steps`). After each evaluation, and every warm-up's length of
    steps between them, the rest is planned again from the steps timed since the warm-up or the
    last evaluation (and that evaluation's measured time), longer or shorter: measuring real
    acceptance costs far more than estimated, on a shared machine a busy spell must not cut a run
    for good, and on a GPU the first steps are several times slower than the rest. Should the run
    fall behind anyway, it ends at the first step after which another one would not fit. Without a
    budget the run is `max_steps` long, as set. The main process decides; the others follow it."""

    def __init__(self, cfg: DictConfig, accelerator, rate: LearningRate, start_step: int):
        minutes, deadline = minutes_setting(cfg, "max_minutes"), minutes_setting(cfg, "deadline_minutes")
        self.seconds = None if minutes is None else minutes * 60
        self.cfg, self.accelerator, self.rate = cfg, accelerator, rate
        self.began = time.perf_counter()  # again at `start`
        self.deadline = None if deadline is None else self.began - process_seconds() + deadline * 60
        self.settle_at = max(MIN_TIMED_STEPS, min(cfg.trainer.warmup_steps, cfg.trainer.max_steps))
        self.start_step = start_step
        self.mark: tuple[int, float] | None = None  # (step, time) the step time is measured from
        self.last_step: tuple[int, float] | None = None
        self.eval_seconds: float | None = None  # the last evaluation's, once one has run
        if (self.seconds is not None or self.deadline is not None) and rate.budgeted:
            # a resumed run keeps the length its budget allowed (restored with the scheduler)
            rate.total = min(rate.total, cfg.trainer.max_steps)
        else:
            rate.total = cfg.trainer.max_steps

    def start(self) -> None:
        self.began = time.perf_counter()
        if self.deadline is not None:
            left = max(self.deadline - self.began, 0.0)
            log.info("deadline %g min: %.1f min of it left for training", self.cfg.trainer.deadline_minutes, left / 60)
            self.seconds = left if self.seconds is None else min(self.seconds, left)

    def step_seconds(self) -> float | None:
        if self.mark is None or self.last_step is None or self.last_step[0] <= self.mark[0]:
            return None
        return (self.last_step[1] - self.mark[1]) / (self.last_step[0] - self.mark[0])

    def after_step(self, done: int) -> None:
        """Called after each optimizer step `done` (1-based): may settle, re-plan or shorten the run."""
        if self.seconds is None:
            return
        now = time.perf_counter()
        self.last_step = (done, now)
        if done == self.start_step + 1:  # timed from its end: the first step includes one-off start-up
            self.mark = (done, now)
            return
        step_seconds = self.step_seconds()
        if step_seconds is None:
            return
        elapsed = now - self.began
        if done == self.settle_at and self.start_step < self.settle_at:
            total = self.agreed(self.steps_that_fit(done, elapsed, step_seconds))
            if total < self.rate.total:
                log.info("time budget %g min: %.2f s per step over steps %d-%d, so %d steps (max_steps %d)",
                         self.seconds / 60, step_seconds, self.start_step + 2, done, total, self.cfg.trainer.max_steps)
                self.rate.total, self.rate.budgeted = total, True
            self.mark = (done, now)  # later plans time the steps after the warm-up's
        elif done < self.rate.total and self.agreed(elapsed + step_seconds > self.seconds):
            log.info("time budget %g min: %.1f min spent, stopping at step %d of %d", self.seconds / 60,
                     elapsed / 60, done, self.rate.total)
            self.rate.total, self.rate.budgeted = done, True
        elif done % self.settle_at == 0 and done > self.settle_at and not eval_due(done, self.cfg.trainer):
            self.replan(done, elapsed, step_seconds)

    def after_eval(self, done: int, seconds: float) -> None:
        """Called after the evaluation at step `done` took `seconds`: plans the rest again."""
        self.eval_seconds = seconds
        step_seconds = self.step_seconds()
        settled = done >= self.settle_at or self.start_step >= self.settle_at
        if self.seconds is not None and step_seconds is not None and settled:
            self.replan(done, time.perf_counter() - self.began, step_seconds)
        if self.last_step is not None:
            self.mark = (done, time.perf_counter())  # the next step time is measured from here

    def replan(self, done: int, elapsed: float, step_seconds: float) -> None:
        """The run's length from the step time measured lately: what fits in the time left."""
        if done >= self.rate.total:
            return
        total = self.agreed(self.steps_that_fit(done, elapsed, step_seconds))
        if abs(total - self.rate.total) * 100 >= self.rate.total:  # a change under 1% is not news
            evaluation = "" if self.eval_seconds is None else f" and {self.eval_seconds:.0f} s an evaluation"
            log.info("time budget %g min: %.2f s per step lately%s, so %d steps, not %d", self.seconds / 60,
                     step_seconds, evaluation, total, self.rate.total)
        if total != self.rate.total:
            self.rate.total, self.rate.budgeted = total, True

    def steps_that_fit(self, done: int, elapsed: float, step_seconds: float) -> int:
        trainer = self.cfg.trainer
        eval_seconds = self.eval_seconds
        if eval_seconds is None:
            eval_seconds = math.ceil(trainer.eval_max_samples / trainer.batch_size) * step_seconds * EVAL_BATCH_SHARE
        # n more steps cost n * step_seconds, plus the evaluations due on the way and one at the end
        left = self.seconds - elapsed
        fits, evals = done, 1  # the final evaluation
        while fits < trainer.max_steps:
            evals += eval_due(fits + 1, trainer)
            if (fits + 1 - done) * step_seconds + evals * eval_seconds > left:
                break
            fits += 1
        return fits

    def agreed(self, value):
        """The main process's `value` in every process (they must run the same number of steps)."""
        if self.accelerator.num_processes == 1:
            return value
        return broadcast_object_list([value])[0]
