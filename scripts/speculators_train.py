"""Issue 15's peer comparison: vLLM's `speculators` EAGLE-3 head trained with speculators 0.9.0's own
defaults on the data, draft vocabulary and number of training tokens of one of our runs, saved in
its own format for `export.run` to import and `serving.bench` to measure beside ours.

Runs in a side venv (system site packages + `pip install --no-deps speculators==0.9.0 openai
hs_connectors`, as tests/interop/ does), from the repository root:

    /tmp/specvenv/bin/python scripts/speculators_train.py --checkpoint <our run>/checkpoints/latest --out <dir>
    python -m export.run checkpoint=<dir> target=<our run's target> format=native out=<dir>-native
    python -m serving.bench artifact=<dir>-native <the same prompts and options as ours>

Theirs, as their `speculators train` CLI defaults it: Muon (lr 1e-3, weight decay 0.1) on the hidden
matrices and AdamW (lr 1e-3, weight decay 0.01) on the rest, linear decay after 1% warm-up, TTT 3
with every step weighted alike, KL divergence (their eager kernel: the fused one needs a GPU),
gradient norm clipped at 1, embedding and lm_head frozen at the target's, sequences packed into
rows of 8,192 tokens by their sampler and collated by their code (their one-token shift included).
Ours, where theirs would not be comparable or servable here: the architecture flags of our EAGLE-3
(norm_before_residual, norm_before_fc and norm_output false: their eagle3 defaults are true, which
our loop does not compute), our run's precision (their bf16 autocast is emulated on AVX2 CPUs), its
hidden states (read from its offline cache or computed by the target), and its supervised positions
(their loss mask is set to where ours reads the teacher: the predictions of answer tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch
from accelerate import PartialState
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drafters.config.errors import UserError  # noqa: E402
from drafters.storage.artifact import read  # noqa: E402
from drafters.target.model import load_target  # noqa: E402
from training.checkpoint import read_state  # noqa: E402
from training.trainer import make_batch, make_teacher, prepare_data, prepare_vocab  # noqa: E402

DEFAULTS = SimpleNamespace(optimizer="muon", lr=1e-3, weight_decay=0.01, muon_lr=1e-3, muon_momentum=0.95,
                           muon_weight_decay=0.1, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")
TTT_STEPS, TOTAL_SEQ_LEN = 3, 8192


def trained_tokens(checkpoint: str) -> int:
    """The tokens our run had trained on at `checkpoint` (metrics.jsonl's `train/tokens`)."""
    step = read_state(checkpoint).step
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(checkpoint))), "metrics.jsonl")) as handle:
        return max(r["train/tokens"] for r in map(json.loads, handle) if "train/tokens" in r and r["step"] <= step)


def their_model(target, vocab, layers: list[int]):
    """speculators' Eagle3DraftModel with our architecture flags, its verifier-owned weights (token
    embedding, lm_head rows of the draft vocabulary) taken from our target as their
    `load_verifier_weights` takes them from the verifier's files. Our teacher's final state is
    normed already, so their verifier norm is an identity here."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    spec = target.spec
    layer = LlamaConfig(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                        vocab_size=spec.vocab_size, rms_norm_eps=spec.rms_norm_eps, rope_parameters=dict(spec.rope_parameters),
                        max_position_embeddings=spec.max_position_embeddings)
    layer._attn_implementation = "sdpa"  # their flex attention needs compilation on CPU
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=vocab.draft_size, eagle_aux_hidden_state_layer_ids=layers,
        norm_before_residual=False, norm_before_fc=False, norm_output=False, fc_norm=False, embed_requires_grad=False,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(vocab.t2d, vocab.d2t)
    head = target.lm_head_weight.detach().float()[vocab.draft_ids]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_weight.float())
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
    for frozen in (model.embed_tokens, model.lm_head, model.verifier_lm_head):
        frozen.weight.requires_grad_(False)
    model.verifier_norm = torch.nn.Identity()  # not saved: their format leaves it to the verifier
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="one of our EAGLE-3 runs' checkpoints: its data, vocabulary and tokens")
    parser.add_argument("--out", required=True, help="where their head is saved (speculators format)")
    parser.add_argument("--tokens", type=int, help="training tokens (default: as many as our run had trained on)")
    parser.add_argument("--total-seq-len", type=int, default=TOTAL_SEQ_LEN, help="their packed row length")
    args = parser.parse_args()
    from speculators.losses.eager import kl_div_loss
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    state = read_state(args.checkpoint)
    cfg = OmegaConf.create(state.config)
    if cfg.drafter.name != "eagle3":
        print(f"error: --checkpoint {args.checkpoint}: an {cfg.drafter.name} run, not EAGLE-3", file=sys.stderr)
        return 2
    budget = args.tokens or trained_tokens(args.checkpoint)
    target = load_target(cfg.target)
    train_set, eval_set = prepare_data(cfg, target)
    run_dir = os.path.dirname(os.path.dirname(os.path.realpath(args.checkpoint)))
    vocab, _ = prepare_vocab(cfg, target, train_set, run_dir, (args.checkpoint, state))
    layers = list(read(args.checkpoint).hparams["aux_layers"])
    teacher = make_teacher(cfg, target, vocab, layers, train_set, eval_set, PartialState(cpu=True))
    model = their_model(target, vocab, layers)

    def sample(index: int) -> dict:
        """One conversation as their data set yields it, before their shift."""
        batch = make_batch(train_set, [index], 0, target.device)
        captured = teacher("train", [index], batch)
        supervised = torch.zeros_like(batch["loss_mask"][0])
        supervised[:-1] = batch["loss_mask"][0, 1:]  # t where token t+1 is trained: where ours reads the teacher
        length = batch["input_ids"].shape[1]
        return {"input_ids": batch["input_ids"][0], "hidden_states": torch.cat(captured.aux, -1)[0].float(),
                "verifier_last_hidden_states": captured.final[0].float(), "loss_mask": supervised.bool(),
                "lengths": torch.tensor([length]), "position_ids": torch.arange(length)}

    lengths = [len(ids) for ids in train_set["input_ids"]]
    sampler = MultipackDistributedBatchSamplerV2(args.total_seq_len, lengths, num_replicas=1, rank=0, seed=cfg.seed)
    collate = CollateFn(args.total_seq_len, target.spec.hidden_size, num_target_layers=len(layers), dtype=torch.float32,
                        preprocess=shift_batch)
    plan, seen, epoch = [], 0, 0
    while seen < budget:  # their max_steps, sized to our run's tokens
        sampler.set_epoch(epoch)
        for indices in sampler:
            if seen >= budget:
                break
            plan.append(list(indices))
            seen += sum(lengths[i] for i in indices)
        epoch += 1
    optimizers = build_optimizers(model, DEFAULTS)
    schedulers = [get_linear_schedule_with_warmup(o, len(plan) // 100, len(plan)) for o in optimizers]
    call = {"ttt_steps": TTT_STEPS, "ttt_step_loss_decay": 1.0, "loss_config": {"kl_div": (kl_div_loss, 1.0)}}
    print(f"speculators 0.9.0 defaults: {len(plan)} steps of up to {args.total_seq_len} tokens, {seen} tokens "
          f"(ours: {budget}), {epoch} epoch(s) of {len(train_set['input_ids'])} conversations", flush=True)
    model.train()
    began = time.perf_counter()
    for step, indices in enumerate(plan, 1):
        batch = collate([sample(i) for i in indices])
        batch = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
        with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bfloat16"):
            _, loss, _ = model(**batch, **call)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        elapsed = time.perf_counter() - began
        print(f"step {step}/{len(plan)}: loss {loss.item():.3f}, {elapsed / 60:.1f} min, "
              f"about {elapsed / step * (len(plan) - step) / 60:.0f} min left", flush=True)
    model.save_pretrained(args.out)
    print(f"saved {args.out}: import it with python -m export.run checkpoint={args.out} target=... format=native out=...")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as error:  # a checkpoint that is not one, a stale cache, ...: one line
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
