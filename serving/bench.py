"""`python -m serving.bench artifact=<dir> prompts=mtbench n=20 out=res.json`

Plain greedy decoding and speculative decoding on the same prompts in the same process,
interleaved (the machine is shared and noisy); acceptance length, per-position acceptance,
tokens/s of both, speed-up, and whether outputs were identical. Writes JSON and a PNG."""

from __future__ import annotations

import json
import os
import time

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from transformers import DynamicCache

from drafters.config.command import command
from drafters.config.errors import UserError
from drafters.config.settings import check
from drafters.proposal import StepDrafter
from drafters.storage.writes import atomic_file, check_destination, check_writable
from serving.engine import Stats, compare
from serving.settings import Bench


@torch.no_grad()
def hf_generate(target, ids, cfg, lookup_tokens: int | None) -> tuple[int, int, float]:
    """transformers' `generate` loop on the same prompt: plain, or with its zero-training prompt
    lookup (n-gram drafts copied from the prompt) when `lookup_tokens` is set: (new tokens, target
    forwards, seconds)."""
    forwards = []
    counting = target.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    began = time.perf_counter()
    try:
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                                    do_sample=cfg.temperature > 0, temperature=cfg.temperature or None,
                                    top_p=cfg.top_p, prompt_lookup_num_tokens=lookup_tokens,
                                    pad_token_id=target.tokenizer.pad_token_id)
    finally:
        counting.remove()
    return out.shape[1] - ids.shape[1], len(forwards), time.perf_counter() - began


def weights_read(model: torch.nn.Module, run) -> int:
    """Bytes of `model`'s weights that `run()` reads: every parameter of each module it calls, once
    per call (an embedding: only the rows it gathers)."""
    total = 0

    def count(module, args):
        nonlocal total
        if isinstance(module, torch.nn.Embedding):
            total += args[0].numel() * module.weight[0].nbytes
        else:
            total += sum(p.nbytes for p in module.parameters(recurse=False))

    hooks = [m.register_forward_pre_hook(count) for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return total


def alpha_floor(target, drafter, ids, steps: int) -> dict[str, float | None]:
    """A head's memory-traffic floor relative to a target forward: the weight bytes the head reads
    over those one target forward reads. `draft`: per draft over chains of `steps` drafts, context
    extension included (as `alpha` counts it); `step`: one drafter forward after the extension (as
    `alpha_step` counts it; None for drafters that draft everything in one forward). Decoding at
    batch 1 is bound by reading the weights, so alpha / floor is how far drafting is from what it
    must cost."""
    from serving.engine import generate_plain, generate_spec

    plain, spec = [], []  # the runs' Stats
    target_bytes = weights_read(target.model, lambda: plain.append(generate_plain(target, ids, 8, set())[1]))
    per_forward = target_bytes / plain[0].target_forwards
    head_bytes = weights_read(drafter, lambda: spec.append(
        generate_spec(target, drafter, ids, 8, set(), draft="chain", steps=steps)[1]))
    floor = {"draft": (head_bytes / spec[0].head_drafted) / per_forward, "step": None}
    if isinstance(drafter, StepDrafter):
        cache = DynamicCache()
        aux, _ = target.capture(ids, None, drafter.capture_layers(), cache=cache)
        state = drafter.new_cache(cache)
        feature, _ = drafter.extend(state, aux, ids)  # the context's tokens do not change what is read
        token = ids[:, -1:]
        floor["step"] = weights_read(drafter, lambda: drafter.draft_logits(
            drafter.step(state, token, feature, drafter.positions(state.length, token)))) / per_forward
    return floor


def run_set(target, drafter, prompts, cfg, options: dict) -> dict:
    from serving.engine import generate_spec, generate_plain
    from serving.prompts import chat_prompt
    from serving.settings import sampler

    eos = {target.tokenizer.eos_token_id}
    plain_total, spec_total = Stats(), Stats()
    hf_totals = {kind: {"tokens": 0, "forwards": 0, "s": 0.0} for kind in ("lookup", "hf_plain")}
    outcomes, gaps, accepted_per_prompt, plain_outputs = [], [], [], []
    plain_sampler = sampler(cfg)
    for index, text in enumerate(tqdm(prompts, desc="prompts", leave=False)):
        ids = chat_prompt(target.tokenizer, text).to(target.device)
        runs = {}
        order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")  # neither always goes first
        for kind in order:
            if kind == "plain":
                runs[kind] = generate_plain(target, ids, cfg.max_new_tokens, eos, plain_sampler)
            else:
                runs[kind] = generate_spec(target, drafter, ids, cfg.max_new_tokens, eos, **options)
        (plain, plain_stats), (spec, spec_stats) = runs["plain"], runs["spec"]
        for kind, wanted, lookup in (("lookup", cfg.prompt_lookup_tokens > 0, cfg.prompt_lookup_tokens),
                                     ("hf_plain", cfg.hf_plain, None)):
            if wanted:
                for key, value in zip(("tokens", "forwards", "s"), hf_generate(target, ids, cfg, lookup)):
                    hf_totals[kind][key] += value
        plain_total.add(plain_stats)
        spec_total.add(spec_stats)
        accepted_per_prompt.append(sum(spec_stats.accepted_by_pos))
        plain_outputs.append(plain)
        if cfg.temperature <= 0:  # sampled outputs differ by chance: nothing to compare
            exact = target.embed_weight.dtype == torch.float32  # else a near-tie may round either way
            outcome, gap = compare(plain, spec, plain_stats.margins, exact, cfg.tie_tolerance)
            outcomes.append(outcome)
            if gap is not None:
                gaps.append(round(gap, 4))
    totals, proposed, accepted = vars(spec_total), spec_total.proposed_by_pos, spec_total.accepted_by_pos
    plain_rate = plain_total.new_tokens / plain_total.seconds
    plain_forward_s = 1 / plain_rate
    iterations = max(spec_total.target_forwards - len(prompts), 1)  # verification forwards (prefills aside)
    spec_rate = spec_total.new_tokens / spec_total.seconds
    result = {
        "n_prompts": len(prompts),
        "accept_len": spec_total.accept_len,
        "accept_rate_by_pos": [a / p for a, p in zip(accepted, proposed)],
        "drafted_forwards": proposed[0] / iterations if proposed else 0.0,  # share of them that verified drafts
        "tokens_per_s_spec": spec_rate,
        "tokens_per_s_plain": plain_rate,
        "speedup": spec_rate / plain_rate,
        "identical": outcomes.count("identical") / len(outcomes) if outcomes else None,
        "near_tie_divergences": outcomes.count("near_tie") if outcomes else None,
        "unexplained_divergences": outcomes.count("unexplained") if outcomes else None,
        "divergence_top2_gaps": gaps,
        # per speculative iteration (one verification forward each), in milliseconds
        "ms_per_iteration": {key.removesuffix("_s"): 1000 * totals[key] / iterations
                             for key in ("drafting_s", "verify_forward_s", "bookkeeping_s")},
        # relative to a plain target forward (our plain loop's time per token): alpha, the head's time
        # (extensions and steps, n-gram lookups aside) per draft it computed (verified or cut);
        # alpha_step, one drafter forward after the extension
        "alpha": (totals["head_extend_s"] + totals["head_step_s"]) / totals["head_drafted"] / plain_forward_s
        if totals["head_drafted"] else None,
        "alpha_step": totals["head_step_s"] / totals["head_steps"] / plain_forward_s if totals["head_steps"] else None,
        # the lazy context extensions: how many entries each added, and what each cost
        "extension": {"tokens_per_call": totals["head_extended"] / totals["head_extensions"],
                      "ms_per_call": 1000 * totals["head_extend_s"] / totals["head_extensions"]}
        if totals["head_extensions"] else None,
        "new_tokens_spec": spec_total.new_tokens,
        "new_tokens_plain": plain_total.new_tokens,
        "accepted_per_prompt": accepted_per_prompt,
    }
    if cfg.hf_plain:  # speed-ups are quoted against the faster plain loop: ours or transformers'
        result["tokens_per_s_hf_plain"] = hf_totals["hf_plain"]["tokens"] / hf_totals["hf_plain"]["s"]
        result["speedup_over_faster_plain"] = spec_rate / max(plain_rate, result["tokens_per_s_hf_plain"])
    if cfg.prompt_lookup_tokens > 0:
        lookup = hf_totals["lookup"]
        lookup_rate = lookup["tokens"] / lookup["s"]
        result["tokens_per_s_prompt_lookup"] = lookup_rate
        result["accept_len_prompt_lookup"] = lookup["tokens"] / lookup["forwards"]
        result["speedup_prompt_lookup"] = lookup_rate / plain_rate
        result["speedup_over_prompt_lookup"] = spec_rate / lookup_rate
    return result, plain_outputs


def add_engine(cfg, results: dict, prompt_ids: dict[str, list[list[int]]], plain_outputs: dict, float32: bool) -> None:
    """`engine=llamacpp|vllm`: the same prompts and K in that engine, beside our loop's figures."""
    from serving.engines import engine_figures, tokens_per_forward

    figures = engine_figures(cfg.engine, str(cfg.artifact), str(cfg.out), prompt_ids, cfg.steps, cfg.max_new_tokens,
                             float32, cfg.engine_startup_s, plain_outputs, cfg.engine_head)
    for name, figure in figures.items():
        ours = results["datasets"][name]
        # our loop counted as the engine's are: new tokens over (new tokens - accepted drafts)
        ours_len = tokens_per_forward(ours["new_tokens_spec"], sum(ours["accepted_per_prompt"]))
        ours["engine"] = {"name": cfg.engine, **figure, "accept_len_ours_counted_alike": ours_len,
                          "accept_len_over_ours": figure["accept_len"] / ours_len}
        print(f"{name} in {cfg.engine}: accept_len {figure['accept_len']:.2f} (ours {ours_len:.2f}), speed-up "
              f"{figure['speedup']:.2f}x over its plain decoding ({figure['tokens_per_s_spec']:.1f} vs "
              f"{figure['tokens_per_s_plain']:.1f} tokens/s), identical {figure['identical']:.0%}, its plain "
              f"output = ours {figure['plain_matches_ours']:.0%}")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results["datasets"].items():
        rates = result["accept_rate_by_pos"]
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    left.set(title="acceptance rate by draft position", xlabel="position", ylabel="accepted / proposed", ylim=(0, 1))
    left.legend()
    names = list(results["datasets"])
    right.bar(names, [results["datasets"][n]["speedup"] for n in names])
    right.axhline(1.0, color="gray", lw=1)
    right.set(title="speed-up over plain decoding", ylabel="x")
    fig.tight_layout()
    with atomic_file(path) as partial:
        fig.savefig(partial, dpi=100, format="png")
    plt.close(fig)


def check_replaceable(written: tuple[str, str, str], overwrite: bool) -> None:
    """Refuse to replace the results `written` (the .json, .png and .yaml) unless `overwrite`, and then
    only those of an earlier benchmark (its .json holds results), never another file that shares the stem."""
    existing = [path for path in written if os.path.lexists(path)]
    if not existing:
        return
    if not overwrite:
        raise UserError(f"out={written[0]}: {', '.join(existing)} already exist (pass overwrite=true to replace "
                        "an earlier benchmark's results, or choose another out)")
    try:
        with open(written[0]) as handle:
            ours = {"config", "datasets"} <= set(json.load(handle))
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours:
        raise UserError(f"out={written[0]}: {existing[0]} is not an earlier benchmark's result: overwrite=true "
                        "replaces only those; choose another out")


@command("bench")
def main(cfg: DictConfig) -> None:
    from drafters.storage import artifact
    from serving.engine import generate_plain
    from serving.prompts import chat_prompt, check_length, load_prompts
    from serving.settings import announce_precision, check_engine, check_options, spec_options

    check(cfg, Bench)
    check_options(cfg)
    check_engine(cfg)
    names = [cfg.prompts] if isinstance(cfg.prompts, str) else list(cfg.prompts)
    if not names or not all(isinstance(name, str) for name in names):
        raise UserError(f"prompts={cfg.prompts}: name one prompt set or file, or a non-empty list of them")
    stems = [os.path.basename(name) for name in names]  # the results' keys
    if len(set(stems)) < len(stems):
        raise UserError(f"prompts={list(names)}: names the same set twice")
    out, (stem, extension) = str(cfg.out), os.path.splitext(str(cfg.out))
    if extension != ".json":  # the plot and the config go beside it as <stem>.png and <stem>.yaml
        raise UserError(f"out={out}: must name a .json file (the plot and config are written beside it)")
    written = (out, f"{stem}.png", f"{stem}.yaml")
    for path in written:  # before the benchmark's minutes, not after
        check_writable(path)
        check_destination(path, (str(cfg.artifact),))
    check_replaceable(written, cfg.overwrite)
    sets = {name: load_prompts(name, cfg.n) for name in names}
    for name, prompts in sets.items():
        if len(prompts) < cfg.n:
            print(f"note: {name} holds {len(prompts)} prompts; n={cfg.n} runs all of them")
    target, drafter = artifact.load(cfg.artifact, dtype=cfg.dtype)
    for name, prompts in sets.items():
        for number, text in enumerate(prompts, 1):
            check_length(target, chat_prompt(target.tokenizer, text).shape[1], cfg.max_new_tokens,
                         f"prompt {number} of {name}")
    chosen = announce_precision(cfg, target.device)
    generate_plain(target, target.tokenizer("warm up", return_tensors="pt")["input_ids"].to(target.device), 4, set())
    options = spec_options(cfg, target, drafter)
    floor = alpha_floor(target, drafter, chat_prompt(target.tokenizer, sets[names[0]][0]).to(target.device), cfg.steps) if cfg.draft != "ngram" else None
    results = {
        "config": {**OmegaConf.to_container(cfg, resolve=True), "artifact": os.path.abspath(cfg.artifact),
                   "dtype": chosen.name, "dtype_requested": cfg.dtype,
                   "verify_cost": options["schedule"] and options["schedule"].measured},
        "hardware": chosen.hardware.to_dict(),
        "alpha_floor": floor and floor["draft"],
        "alpha_step_floor": floor and floor["step"],
        "datasets": {},
    }
    plain_outputs = {}
    for name, prompts in sets.items():
        result, plain_outputs[os.path.basename(name)] = run_set(target, drafter, prompts, cfg, options)
        results["datasets"][os.path.basename(name)] = result
        result["alpha_over_floor"] = result["alpha"] / floor["draft"] if result["alpha"] and floor else None
        result["alpha_step_over_floor"] = (result["alpha_step"] / floor["step"]
                                           if result["alpha_step"] and floor and floor["step"] else None)
        same = (f"identical {result['identical']:.0%}, unexplained divergences {result['unexplained_divergences']}"
                if result["identical"] is not None else "sampled (outputs not compared)")
        print(f"{name}: accept_len {result['accept_len']:.2f}, speed-up {result['speedup']:.2f}x "
              f"({result['tokens_per_s_spec']:.1f} vs {result['tokens_per_s_plain']:.1f} tokens/s), {same}"
              + (f"; prompt lookup {result['speedup_prompt_lookup']:.2f}x" if "speedup_prompt_lookup" in result else ""))
    if cfg.engine != "ours":
        prompt_ids = {os.path.basename(name): [chat_prompt(target.tokenizer, text)[0].tolist() for text in prompts]
                      for name, prompts in sets.items()}
        add_engine(cfg, results, prompt_ids, plain_outputs, target.embed_weight.dtype == torch.float32)
    check_replaceable(written, cfg.overwrite)  # another run may have written them meanwhile
    with atomic_file(out, replace=cfg.overwrite) as partial, open(partial, "w") as handle:
        json.dump(results, handle, indent=1)
    plot(results, f"{stem}.png")
    with atomic_file(f"{stem}.yaml") as partial:
        OmegaConf.save(cfg, partial)
    print(f"wrote {out}, {stem}.png and {stem}.yaml")


if __name__ == "__main__":
    main()
