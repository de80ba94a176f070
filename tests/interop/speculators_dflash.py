"""Interop check: vLLM's `speculators` package loads our speculators-format export of a DFlash or
DSpark head and computes the same block logits as ours.

Not part of the pytest suite: speculators lives in a side venv that also sees the system site
packages, so this one process runs both our code and theirs. From the repository root:

    /tmp/specvenv/bin/python tests/interop/speculators_dflash.py [--drafter dspark]
    /tmp/specvenv/bin/python tests/interop/speculators_dflash.py --artifact <native artifact or checkpoint>

Without --artifact it builds a random head of `--drafter` on the tests' tiny random Llama (every
trainable weight perturbed, so norms and the Markov head are not trivially ones/zeros) and saves it
as a native artifact. It exports that with `export.run format=speculators verifier_out=...` (the
target written as HF safetensors: speculators takes the embedding from it), loads the dir with
`DFlashDraftModel` / `DSparkDraftModel.from_pretrained` (sdpa attention: flex attention needs
compilation on CPU), and checks that every file tensor is loaded bitwise and that the embedding is
the target's. Then both sides run on the target's hidden states of one sequence, with blocks
anchored at a few positions: speculators' own training forward (one block per anchor; the loss mask
is set at exactly those positions so its anchor sampling picks them all), its draft logits
(`lm_head`), DSpark's Markov bias (`markov_w2`) and confidence logits (`confidence_head`) caught
with forward hooks; ours one serving block per anchor (the context before it cached, the anchor
committed), DSpark's bias and confidence from the data token before each drafted one, as
speculators feeds them with sample_from_anchor=false. Float32 throughout.
Exit code 0 iff no missing/unexpected keys and max |diff| <= --tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from speculators_eagle3 import VERIFIER_OWNED, export

from drafters.base import build_drafter
from drafters.storage.artifact import (
    SavedDrafter,
    default_proposal,
    read,
    verifier_of,
    write_native,
)
from drafters.target.model import load_target
from drafters.target.vocab import build_draft_vocab

TEXT = ("KV caches store the keys and values of every past token, so each new token attends to them "
        "without recomputing the whole prefix. They trade memory for speed.")
TINY_TARGET = ["target=tiny_llama", "+target.random_init.initializer_range=0.3"]


def random_artifact(drafter_name: str, directory: str) -> str:
    """A random DFlash/DSpark on the tiny Llama, saved as a native artifact; returns its path."""
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        rank = ["drafter.markov_rank=32"] if drafter_name == "dspark" else []
        cfg = compose(config_name="train", overrides=[*TINY_TARGET, f"drafter={drafter_name}", *rank])
    target = load_target(cfg.target)
    stream = torch.randint(0, target.spec.vocab_size, (20000,), generator=torch.Generator().manual_seed(0)).tolist()
    vocab = build_draft_vocab([(stream, [1] * len(stream))], target.spec.vocab_size, 1024, {"random": 1})
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, target, vocab)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.add_(0.1 * torch.randn_like(parameter))
    target_cfg = OmegaConf.to_container(cfg.target, resolve=True)
    hparams = drafter.hparams()
    saved = SavedDrafter(drafter.name, hparams, verifier_of(target.spec.to_dict(), target_cfg), target_cfg,
                         {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()},
                         default_proposal(drafter.name, hparams))
    path = os.path.join(directory, "native")
    os.mkdir(path)
    write_native(saved, path)
    return path


def ours_blocks(drafter, aux, ids, anchors):
    """Per anchor: (draft logits [1, block, V_draft], and for DSpark the Markov bias and confidence
    logits of slots 1..block-1), one serving block forward each."""
    size, out = drafter.block_size, []
    for anchor in anchors:
        hidden = drafter.block_hidden(drafter.new_cache(), [state[:, :anchor] for state in aux], ids[:, 1:anchor + 1])
        parts = [drafter.lm_head(hidden)]
        if drafter.name == "dspark":  # slot k's previous token: the data token at anchor + k - 1
            parts += drafter.markov(hidden[:, 1:], ids[:, anchor:anchor + size - 1])
        out.append(parts)
    return out


def theirs_blocks(model, aux, ids, anchors):
    """The same from speculators' training forward, caught by hooks and cut per block."""
    caught = {}
    modules = {"logits": model.lm_head}
    if getattr(model, "markov_head", None) is not None:
        modules |= {"bias": model.markov_head.markov_w2, "confidence": model.confidence_head}
    hooks = [module.register_forward_hook(lambda _m, _a, output, key=key: caught.setdefault(key, output))
             for key, module in modules.items()]
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, anchors] = 1
    # its loss (computed, unused) in plain torch: the fused Triton kernels need a GPU
    loss_kwargs, _ = model.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    try:
        model(hidden_states=torch.cat(aux, -1), input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=aux[-1],
              document_ids=torch.zeros_like(ids), **{**loss_kwargs, "max_anchors": len(anchors)})
    finally:
        for hook in hooks:
            hook.remove()
    size, out = model.block_size, []
    for block in range(len(anchors)):
        parts = [caught["logits"][:, block * size:(block + 1) * size]]
        if "bias" in caught:  # both [blocks, size, ...]; slot 0 (the anchor) drafts nothing
            parts += [caught["bias"][block:block + 1, 1:], caught["confidence"][block:block + 1, 1:]]
        out.append(parts)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifact", help="a DFlash/DSpark native artifact or training checkpoint (default: a random one)")
    parser.add_argument("--drafter", default="dflash", choices=["dflash", "dspark"], help="without --artifact")
    parser.add_argument("--anchors", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()

    from speculators import SpeculatorModelConfig
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel

    with tempfile.TemporaryDirectory() as workdir:
        artifact = args.artifact or random_artifact(args.drafter, workdir)
        exported = export(artifact, workdir)
        config = SpeculatorModelConfig.from_pretrained(exported)
        config.transformer_layer_config._attn_implementation = "sdpa"
        model_class = {"dflash": DFlashDraftModel, "dspark": DSparkDraftModel}[config.speculators_model_type]
        theirs = model_class.from_pretrained(exported, config=config).float().eval()

        saved = read(artifact)
        ours = saved.build(artifact).float().eval()
        target = load_target(OmegaConf.merge(OmegaConf.create(saved.target), {"dtype": "float32"}))

        file_weights = load_file(os.path.join(exported, "model.safetensors"))
        model_weights = theirs.state_dict()
        unexpected = sorted(file_weights.keys() - model_weights.keys())
        missing = sorted(model_weights.keys() - file_weights.keys() - VERIFIER_OWNED - {"embed_tokens.weight"})
        differ = sorted(name for name in file_weights.keys() & model_weights.keys()
                        if not torch.equal(file_weights[name].to(model_weights[name].dtype), model_weights[name]))
        embedding_ok = torch.equal(model_weights["embed_tokens.weight"], ours.embed_tokens.weight)
        print(f"speculators {type(theirs).__name__}: missing keys {missing}, unexpected keys {unexpected}, "
              f"weights not loaded bitwise {differ}, embedding = the target's: {embedding_ok}")
        print(f"  aux layer ids {theirs.target_layer_ids}, block_size {theirs.block_size}, mask token "
              f"{theirs.mask_token_id}, sample_from_anchor {theirs.config.sample_from_anchor}, "
              f"layers {len(theirs.layers)}")

        ids = target.tokenizer(TEXT, return_tensors="pt")["input_ids"]
        last = ids.shape[1] - ours.block_size - 1  # speculators anchors no block in the last block_size positions
        anchors = torch.linspace(1, last, args.anchors).round().long().unique().tolist()
        with torch.no_grad():
            aux, _ = target.capture(ids, None, ours.capture_layers())
            aux = [state.float() for state in aux]
            pairs = zip(ours_blocks(ours, aux, ids, anchors), theirs_blocks(theirs, aux, ids, anchors))
            names = ["logits", "markov bias", "confidence logits"]
            diffs = {}
            for our_parts, their_parts in pairs:
                for name, a, b in zip(names, our_parts, their_parts):
                    diffs[name] = max(diffs.get(name, 0.0), (a - b.reshape(a.shape)).abs().max().item())
        scale = max(parts[0].abs().max().item() for parts in ours_blocks(ours, aux, ids, anchors))
        print(f"{ours.name} blocks of {ours.block_size} at anchors {anchors} of {ids.shape[1]} tokens "
              f"(|logit| up to {scale:.1f}), max |ours - speculators|: "
              + ", ".join(f"{name} {diff:.2e}" for name, diff in diffs.items()))
        ok = not (missing or unexpected or differ) and embedding_ok and max(diffs.values()) <= args.tolerance
        print("PASS" if ok else f"FAIL (tolerance {args.tolerance})")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
