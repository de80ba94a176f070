"""Time one EAGLE-3 training step (forward + backward, 7 TTT steps) of ours and of vLLM's
`speculators` library on the same shapes (SmolLM2-135M: hidden 576, 9/3 heads, vocab 49152,
draft vocab 8192), interleaved, on random hidden states. Needs `pip install --no-deps
speculators` plus its light deps in a separate venv; not part of the test suite.

    python scripts/speculators_step.py --tokens 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drafters.base import Captured  # noqa: E402
from drafters.eagle3 import Eagle3  # noqa: E402
from drafters.target.model import TargetSpec  # noqa: E402
from drafters.target.vocab import build_draft_vocab  # noqa: E402

SPEC = TargetSpec(name="smollm2-135m", model_type="llama", hidden_size=576, num_layers=30, vocab_size=49152,
                  num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, max_position_embeddings=8192)
DRAFT_VOCAB = 8192


def ours(tokens: int, sequences: int, device: torch.device = torch.device("cpu")):
    vocab = build_draft_vocab([(list(range(DRAFT_VOCAB)), [1] * DRAFT_VOCAB)], SPEC.vocab_size, DRAFT_VOCAB, {})
    cfg = OmegaConf.create({"name": "eagle3", "aux_layers": None, "ttt_steps": 7, "loss_decay": 0.8})
    model = Eagle3(cfg, SPEC, vocab).to(device)
    length = tokens // sequences
    ids = torch.randint(0, SPEC.vocab_size, (sequences, length), device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    captured = Captured(
        aux=[torch.randn(sequences, length, 576, dtype=torch.bfloat16, device=device) for _ in range(3)],
        final=torch.randn(sequences, length, 576, dtype=torch.bfloat16, device=device),
        teacher_logits=torch.randn(sequences, length, DRAFT_VOCAB, dtype=torch.bfloat16, device=device),
        in_vocab=torch.ones(sequences, length, dtype=torch.bool, device=device),
        teacher_token=torch.randint(0, DRAFT_VOCAB, (sequences, length), device=device),
    )

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, _ = model.loss(batch, captured)
        loss.backward()

    return step


def theirs(tokens: int, sequences: int, device: torch.device = torch.device("cpu")):
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, num_hidden_layers=1, vocab_size=SPEC.vocab_size, rms_norm_eps=1e-5,
                        rope_parameters=dict(SPEC.rope_parameters), max_position_embeddings=8192)
    layer._attn_implementation = os.environ.get("SPECULATORS_ATTN", "sdpa")
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=[2, 15, 27],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=7)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
    )
    model = Eagle3DraftModel(config).to(device)
    with torch.no_grad():
        for parameter in model.parameters():
            if torch.isnan(parameter).any():
                parameter.normal_(0, 0.02)
        model.t2d[:DRAFT_VOCAB] = True
    model.lm_head.weight.requires_grad_(True)  # ours trains its head too
    length = tokens // sequences
    hidden = torch.randn(1, tokens, 3 * 576, dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, SPEC.vocab_size, (1, tokens), device=device)
    documents = torch.arange(sequences, device=device).repeat_interleave(length).unsqueeze(0)
    last = torch.randn(1, tokens, 576, dtype=torch.bfloat16, device=device)

    def soft_cross_entropy(logits, targets):
        # speculators' own losses are fused Triton kernels (GPU only); this is the same loss in torch
        return torch.nn.functional.cross_entropy(logits.float(), torch.softmax(targets.float(), -1))

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(hidden, ids, documents, loss_mask=torch.ones(1, tokens, dtype=torch.bool, device=device),
                        verifier_last_hidden_states=last, ttt_steps=7, ttt_step_loss_decay=0.8,
                        loss_config={"ce": (soft_cross_entropy, 1.0)})
        loss = out[1] if isinstance(out, tuple) else out.loss
        loss.backward()

    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, cuda (ROCm: cuda too)")
    args = parser.parse_args()
    device = torch.device(args.device)
    steps = {"specdraft": ours(args.tokens, args.sequences, device),
             "speculators": theirs(args.tokens, args.sequences, device)}
    for step in steps.values():  # warm-up
        step()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):  # interleaved: the machine is shared and noisy
        for name, step in steps.items():
            began = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - began)
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:12s} median {median:.2f} s/step  {args.tokens / median:.0f} tokens/s  ({args.repeats} runs)")
    ratio = statistics.median(times["speculators"]) / statistics.median(times["specdraft"])
    print(f"speculators / specdraft step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
