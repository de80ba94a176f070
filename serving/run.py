"""`python -m serving.run artifact=<dir> prompt="..."`: generate with speculative decoding + stats."""

from __future__ import annotations

import sys

import torch
from omegaconf import DictConfig, OmegaConf

from drafters import precision
from drafters.errors import UserError, command
from drafters.precision import Precision
from drafters.settings import check
from serving.settings import Serve


def chat_prompt(tokenizer, text: str):
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def check_length(target, prompt_tokens: int, max_new_tokens: int, what: str) -> None:
    """A prompt and its answer must fit in the target's positions (and so in its KV cache)."""
    positions = target.spec.max_position_embeddings
    if prompt_tokens + max_new_tokens > positions:
        raise UserError(f"{what}: {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceed the "
                        f"{positions} positions of target {target.spec.name}")


def announce_precision(cfg: DictConfig, device: torch.device) -> Precision:
    """The one line that says which precision serving runs in on `device`, and why."""
    chosen = precision.resolve(cfg.dtype, device)
    print(f"precision: {chosen.describe()}; {chosen.hardware.describe()}", file=sys.stderr)
    return chosen


def sampler(cfg: DictConfig):
    from serving.engine import Sampler

    return Sampler(cfg.temperature, cfg.top_p, torch.Generator().manual_seed(cfg.seed))


def check_options(cfg: DictConfig) -> None:
    """The checks across keys of a serve/bench config that need no model."""
    if cfg.ngram.shortest > cfg.ngram.longest:
        raise UserError(f"ngram.shortest={cfg.ngram.shortest} is above ngram.longest={cfg.ngram.longest}")
    if cfg.schedule == "auto" and _tree(cfg):
        raise UserError("schedule=auto schedules chains: pass draft=chain | ngram | hybrid with ngram.head=chain")
    if cfg.schedule == "auto" and (cfg.cost_schedule or cfg.min_confidence > 0):
        key = "cost_schedule=true" if cfg.cost_schedule else f"min_confidence={cfg.min_confidence}"
        raise UserError(f"{key} is for schedule=fixed: schedule=auto chooses how many drafts to verify itself")


def _tree(cfg: DictConfig) -> bool:
    return cfg.draft == "tree" or (cfg.draft == "hybrid" and cfg.ngram.head == "tree")


def spec_options(cfg: DictConfig, target, drafter) -> dict:
    """generate_spec's keyword arguments from a serve/bench config (`cost_schedule` measures the
    target's verification cost here, once)."""
    from serving.engine import NgramOptions, measure_verify_cost
    from serving.ngram import NgramDrafts
    from serving.schedule import AutoSchedule

    if _tree(cfg) and cfg.topk > drafter.vocab.draft_size:
        raise UserError(f"topk={cfg.topk}: more children per node than the drafter's "
                        f"{drafter.vocab.draft_size}-token draft vocabulary")
    # the engine never drafts past max_new_tokens
    most = min(cfg.steps + (cfg.ngram.length if cfg.schedule == "auto" else 0), cfg.max_new_tokens) + 1
    layers = [] if cfg.draft == "ngram" else drafter.capture_layers()
    measure = cfg.cost_schedule or cfg.schedule == "auto"
    verify_cost = measure_verify_cost(target, layers, most) if measure else None
    ngram = OmegaConf.to_container(cfg.ngram)
    earlier = ngram.pop("earlier")
    return dict(draft=cfg.draft, steps=cfg.steps, min_confidence=cfg.min_confidence, depth=cfg.depth, topk=cfg.topk,
                total=cfg.total_tokens, sampler=sampler(cfg), verify_cost=verify_cost,
                schedule=AutoSchedule(verify_cost, cfg.steps) if cfg.schedule == "auto" else None,
                ngram=NgramOptions(**ngram),
                earlier=NgramDrafts([], ngram["shortest"], ngram["longest"]) if earlier else None)


@command("serve")
def main(cfg: DictConfig) -> None:
    from serving import artifact
    from serving.engine import generate_spec, generate_plain

    check(cfg, Serve)
    check_options(cfg)
    if not cfg.prompt.strip():
        raise UserError("prompt is empty: pass prompt=\"...\"")
    target, drafter = artifact.load(cfg.artifact, dtype=cfg.dtype)
    announce_precision(cfg, target.device)
    ids = chat_prompt(target.tokenizer, cfg.prompt).to(target.device)
    check_length(target, ids.shape[1], cfg.max_new_tokens, "prompt")
    eos = {target.tokenizer.eos_token_id}
    tokens, stats = generate_spec(target, drafter, ids, cfg.max_new_tokens, eos, **spec_options(cfg, target, drafter))
    print(target.tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"\n[spec] {stats.new_tokens} tokens, {stats.target_forwards} target forwards, "
          f"acceptance length {stats.accept_len:.2f}, {stats.new_tokens / stats.seconds:.1f} tokens/s")
    if cfg.compare_plain:
        plain, plain_stats = generate_plain(target, ids, cfg.max_new_tokens, eos, sampler(cfg))
        # sampled outputs differ by chance; only greedy outputs must be identical
        same = plain == tokens if cfg.temperature <= 0 else "n/a (sampling)"
        print(f"[plain] {plain_stats.new_tokens / plain_stats.seconds:.1f} tokens/s; "
              f"speed-up {plain_stats.seconds / stats.seconds * stats.new_tokens / plain_stats.new_tokens:.2f}x; "
              f"identical output: {same}")


if __name__ == "__main__":
    main()
