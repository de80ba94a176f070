"""conf/serve.yaml's and conf/bench.yaml's schemas, checked before the artifact loads
(drafters/config/settings.py says how), and what the settings become for the engine."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from drafters.config.errors import UserError
from drafters.config.settings import PRECISIONS, above, anything, at_least, between, nonempty, one_of
from drafters.storage import artifact, engines
from drafters.target import precision
from drafters.target.precision import Precision
from serving.engines import check_head


@dataclass
class Ngram:
    shortest: int = at_least(1)
    longest: int = at_least(1)
    branches: int = at_least(1)
    length: int = at_least(1)
    head: str = one_of("chain", "tree")
    earlier: bool = anything()


@dataclass
class Decoding:
    """What serving.run and serving.bench share: the artifact and how to decode with it."""

    artifact: str = nonempty()
    max_new_tokens: int = at_least(1)
    dtype: str = one_of(*PRECISIONS)
    draft: str = one_of("chain", "tree", "ngram", "hybrid")
    steps: int | None = at_least(1)  # null: the unroll the head was trained for
    min_confidence: float = between(0, 1)
    schedule: str | None = one_of("fixed", "auto")  # null: auto where it applies (check_options)
    depth: int = at_least(1)
    topk: int = at_least(1)
    total_tokens: int = at_least(1)
    ngram: Ngram = anything()
    temperature: float = at_least(0)
    top_p: float = between(0, 1, open_low=True)
    seed: int = between(0, 2**32 - 1)  # numpy's seed range, as in training
    tie_tolerance: float = at_least(0)


@dataclass
class Serve(Decoding):
    prompt: str = anything()
    compare_plain: bool = anything()


@dataclass
class Bench(Decoding):
    prompts: object = anything()  # a set's name or file, or a list of them (serving/prompts.py checks each)
    n: int = at_least(1)
    prompt_lookup_tokens: int = at_least(0)
    hf_plain: bool = anything()
    engine: str = one_of("ours", "llamacpp", "vllm")
    engine_startup_s: float = above(0)
    engine_head: str | None = anything()
    out: str = nonempty()
    overwrite: bool = anything()


def announce_precision(cfg: DictConfig, device: torch.device) -> Precision:
    """The one line that says which precision serving runs in on `device`, and why."""
    chosen = precision.resolve(cfg.dtype, device)
    print(f"precision: {chosen.describe()}; {chosen.hardware.describe()}", file=sys.stderr)
    return chosen


def sampler(cfg: DictConfig):
    from serving.engine import Sampler

    return Sampler(cfg.temperature, cfg.top_p, torch.Generator().manual_seed(cfg.seed))


def check_options(cfg: DictConfig) -> None:
    """The checks across keys of a serve/bench config that need no model; `schedule=null` becomes
    auto where it can schedule the draft (a chain head, no min_confidence), else fixed."""
    if cfg.ngram.shortest > cfg.ngram.longest:
        raise UserError(f"ngram.shortest={cfg.ngram.shortest} is above ngram.longest={cfg.ngram.longest}")
    if cfg.schedule is None:
        cfg.schedule = "fixed" if _tree(cfg) or cfg.min_confidence > 0 else "auto"
    if cfg.schedule == "auto" and _tree(cfg):
        raise UserError("schedule=auto schedules chains: pass draft=chain | ngram | hybrid with ngram.head=chain")
    if cfg.schedule == "auto" and cfg.min_confidence > 0:
        raise UserError(f"min_confidence={cfg.min_confidence} is for schedule=fixed: schedule=auto chooses how many "
                        "drafts to verify itself")


def check_engine(cfg: DictConfig) -> None:
    """An engine beside our loop is compared greedy, on fixed chains of `steps` drafts."""
    if cfg.engine == "ours":
        return
    wrong = {"draft": cfg.draft != "chain", "schedule": cfg.schedule != "fixed", "temperature": cfg.temperature > 0,
             "min_confidence": cfg.min_confidence > 0}
    named = [f"{key}={cfg[key]}" for key, differs in wrong.items() if differs]
    if named:
        raise UserError(f"engine={cfg.engine}: {', '.join(named)}: an engine is compared with our loop greedy, on "
                        "fixed chains (draft=chain schedule=fixed temperature=0 min_confidence=0)")
    head = cfg.engine_head
    if head and not os.path.exists(head):
        raise UserError(f"engine_head={head}: no such file or directory")
    if head and cfg.engine == "llamacpp" and not (os.path.isfile(head) and head.endswith(".gguf")):
        raise UserError(f"engine_head={head}: llama.cpp serves a head .gguf file (export format=gguf writes one)")
    if head and cfg.engine == "vllm" and not os.path.isfile(os.path.join(head, "config.json")):
        raise UserError(f"engine_head={head}: vLLM serves a head directory with a config.json "
                        "(export format=speculators writes one)")
    check_head(cfg.engine, artifact.read(str(cfg.artifact)))
    {"llamacpp": engines.llama_server, "vllm": engines.vllm_python}[cfg.engine]()  # installed, or how to install it


def _tree(cfg: DictConfig) -> bool:
    return cfg.draft == "tree" or (cfg.draft == "hybrid" and cfg.ngram.head == "tree")


def spec_options(cfg: DictConfig, target, drafter) -> dict:
    """generate_spec's keyword arguments from a serve/bench config (`schedule=auto` measures the
    target's verification cost here, once); `steps=null` becomes what the head's artifact records
    (export's `steps=`), else its drafter's default."""
    from serving.engine import NgramOptions, measure_verify_cost
    from serving.ngram import NgramDrafts
    from serving.schedule import AutoSchedule

    if cfg.steps is None:
        cfg.steps = drafter.proposal_steps or drafter.default_steps(drafter.hparams())
    if _tree(cfg) and cfg.topk > drafter.vocab.draft_size:
        raise UserError(f"topk={cfg.topk}: more children per node than the drafter's "
                        f"{drafter.vocab.draft_size}-token draft vocabulary")
    # the engine never drafts past max_new_tokens
    most = min(cfg.steps + (cfg.ngram.length if cfg.schedule == "auto" else 0), cfg.max_new_tokens) + 1
    layers = [] if cfg.draft == "ngram" else drafter.capture_layers()
    schedule = AutoSchedule(measure_verify_cost(target, layers, most), cfg.steps) if cfg.schedule == "auto" else None
    ngram = OmegaConf.to_container(cfg.ngram)
    earlier = ngram.pop("earlier")
    return dict(draft=cfg.draft, steps=cfg.steps, min_confidence=cfg.min_confidence, depth=cfg.depth, topk=cfg.topk,
                total=cfg.total_tokens, sampler=sampler(cfg), schedule=schedule,
                ngram=NgramOptions(**ngram),
                earlier=NgramDrafts([], ngram["shortest"], ngram["longest"]) if earlier else None)
