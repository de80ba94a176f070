"""Interop check: vLLM's `speculators` package loads our speculators-format export of a real
SmolLM2 EAGLE-3 head and computes the same draft logits as ours.

Not part of the pytest suite: speculators pulls heavy dependencies, so it lives in a side venv
(system site packages + `pip install --no-deps speculators==0.9.0` and its light deps). Run from
the repository root:

    /tmp/specvenv/bin/python tests/interop/speculators_eagle3.py [--checkpoint <run>/checkpoints/latest]

It exports the checkpoint with `export.run format=speculators verifier_out=...` (the GGUF target
written as an HF safetensors dir, which speculators reads for the verifier config and weights),
loads it with `Eagle3DraftModel.from_pretrained`, checks that every file tensor is a model
weight and every model weight comes from the file (bitwise), then runs both drafters on the
target's real hidden states for a few teacher-forced TTT steps and compares the logits in float32.
Exit code 0 iff no missing/unexpected keys and max |diff| <= --tolerance.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from drafters.layers import UnrolledAttention  # noqa: E402
from drafters.storage.artifact import read  # noqa: E402
from drafters.target.model import load_target  # noqa: E402

TEXT = ("KV caches store the keys and values of every past token, so each new token attends to them "
        "without recomputing the whole prefix. They trade memory for speed, and their size grows with "
        "the context length, the number of layers and the number of key-value heads.")
VERIFIER_OWNED = {"verifier_norm.weight", "verifier_lm_head.weight"}  # speculators loads these from the verifier


def export(checkpoint: str, workdir: str) -> str:
    out = os.path.join(workdir, "speculators")
    subprocess.run([sys.executable, "-m", "export.run", f"checkpoint={checkpoint}", "format=speculators", f"out={out}",
                    f"verifier_out={os.path.join(workdir, 'verifier')}"], cwd=ROOT, check=True)
    return out


def ours_logits(drafter, aux, ids, steps):
    """Our drafter's logits at every position for TTT steps 0..steps-1, teacher-forced (step k at
    position t reads token t+1+k): the unroll Eagle3.loss trains, with all rows kept."""
    feature = drafter.fuse(aux)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    attend, logits = UnrolledAttention(), []
    for k in range(steps):
        tokens = F.pad(ids[:, 1 + k:], (0, 1 + k))
        cos, sin = drafter.rotary(feature, positions + k)
        feature = drafter.midlayer(drafter.embed_tokens(tokens), feature, cos, sin, attend)
        logits.append(drafter.lm_head(drafter.norm(feature)))
    return logits


def theirs_logits(model, aux, ids, steps):
    """speculators' forward on the same inputs: its input_ids are the next tokens (ours shifted by one),
    its TTT steps teacher-force the same way; logits are taken from its lm_head at each step."""
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _module, _args, output: logits.append(output))
    try:
        model(hidden_states=torch.cat(aux, -1), input_ids=F.pad(ids[:, 1:], (0, 1)),
              document_ids=torch.zeros_like(ids), position_ids=torch.arange(ids.shape[1]).unsqueeze(0),
              ttt_steps=steps)
    finally:
        hook.remove()
    return logits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="/work/runs/full3/checkpoints/latest")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()

    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    with tempfile.TemporaryDirectory() as workdir:
        exported = export(args.checkpoint, workdir)
        config = SpeculatorModelConfig.from_pretrained(exported)
        config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention needs compilation on CPU
        theirs = Eagle3DraftModel.from_pretrained(exported, config=config).float().eval()

        file_weights = load_file(os.path.join(exported, "model.safetensors"))
        model_weights = theirs.state_dict()
        unexpected = sorted(file_weights.keys() - model_weights.keys())
        missing = sorted(model_weights.keys() - file_weights.keys() - VERIFIER_OWNED)
        differ = sorted(name for name in file_weights.keys() & model_weights.keys()
                        if not torch.equal(file_weights[name].to(model_weights[name].dtype), model_weights[name]))
        print(f"speculators {type(theirs).__name__}: missing keys {missing}, unexpected keys {unexpected}, "
              f"weights not loaded bitwise {differ}")
        print(f"  aux layer ids {theirs.config.eagle_aux_hidden_state_layer_ids}, norm_before_residual "
              f"{theirs.config.norm_before_residual}, norm_before_fc {theirs.config.norm_before_fc}, "
              f"fc_norm {theirs.config.fc_norm}, norm_output {theirs.config.norm_output}")

        saved = read(args.checkpoint)
        ours = saved.build(args.checkpoint).float().eval()
        target = load_target(OmegaConf.merge(OmegaConf.create(saved.target), {"dtype": "float32"}))
        messages = [{"role": "user", "content": "Explain KV caches."}, {"role": "assistant", "content": TEXT}]
        rendered = target.tokenizer.apply_chat_template(messages, tokenize=False)
        ids = target.tokenizer(rendered, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            aux, _ = target.capture(ids, None, ours.capture_layers())
            aux = [state.float() for state in aux]
            diffs = [(a - b).abs().max().item() for a, b in
                     zip(ours_logits(ours, aux, ids, args.steps), theirs_logits(theirs, aux, ids, args.steps))]
        scale = max(logit.abs().max().item() for logit in ours_logits(ours, aux, ids, 1))
        print(f"draft logits on {ids.shape[1]} tokens of SmolLM2 hidden states (|logit| up to {scale:.1f}), "
              f"max |ours - speculators| per TTT step: {', '.join(f'{d:.2e}' for d in diffs)}")
        ok = not (missing or unexpected or differ) and max(diffs) <= args.tolerance
        print("PASS" if ok else f"FAIL (tolerance {args.tolerance})")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
