"""`python -m serving.run artifact=<dir> prompt="..."`: generate with speculative decoding + stats."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from drafters.config.command import command
from drafters.config.errors import UserError
from drafters.config.settings import check
from serving.prompts import chat_prompt, check_length
from serving.settings import Serve, announce_precision, check_options, sampler, spec_options


@command("serve")
def main(cfg: DictConfig) -> None:
    from drafters.storage import artifact
    from serving.engine import compare, generate_plain, generate_spec

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
    shape = f"depth={cfg.depth}" if cfg.draft == "tree" else f"steps={cfg.steps}"
    print(f"\n[spec] draft={cfg.draft} schedule={cfg.schedule} {shape}: {stats.new_tokens} tokens, "
          f"{stats.target_forwards} target forwards, "
          f"acceptance length {stats.accept_len:.2f}, {stats.new_tokens / stats.seconds:.1f} tokens/s")
    if cfg.compare_plain:
        plain, plain_stats = generate_plain(target, ids, cfg.max_new_tokens, eos, sampler(cfg))
        # sampled outputs differ by chance; only greedy outputs must be identical
        same = "n/a (sampling)"
        if cfg.temperature <= 0:
            exact = target.embed_weight.dtype == torch.float32
            outcome, gap = compare(plain, tokens, plain_stats.margins, exact, cfg.tie_tolerance)
            same = str(outcome == "identical")
            if outcome == "near_tie":
                same += f", at a rounding near-tie (plain decoding's top-2 logits {gap:.3f} apart there)"
        print(f"[plain] {plain_stats.new_tokens / plain_stats.seconds:.1f} tokens/s; "
              f"speed-up {plain_stats.seconds / stats.seconds * stats.new_tokens / plain_stats.new_tokens:.2f}x; "
              f"identical output: {same}")


if __name__ == "__main__":
    main()
