"""drafter=mtp: DeepSeek-V3-style MTP, (a) trained from scratch on a target's own architecture and
(b) fine-tuned from native MTP weights in small synthetic DeepSeek-V3 and Qwen3-Next checkpoints,
written back under the same keys; training unrolls what serving runs; serving stays lossless."""

import json
import os
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import (batch_vocab, compose_train, distilled_setup, lossless_accept_len, self_distilled_batch,
                      train_steps, trained_on)
from drafters.base import build_drafter, capture
from drafters.config.errors import UserError
from drafters.layers import DraftCache
from drafters.losses import normalized_decay
from drafters.storage.artifact import SavedDrafter, read, verifier_of, write_native
from drafters.target.model import load_target
from export import formats

TINY = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_attention_heads=4, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
DEEPSEEK = dict(num_hidden_layers=2, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16, q_lora_rank=16,
                kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4, num_nextn_predict_layers=1)
QWEN3_NEXT = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_value_heads=2,
                  linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


SOME_TOKENS = {"input_ids": torch.arange(8)}


def mtp(target, vocab, *overrides):
    torch.manual_seed(0)
    return build_drafter(compose_train(["drafter=mtp", *overrides]).drafter, target, vocab)


def synthetic_checkpoint(directory, tokenizer, model_type, settings, extra, layer, prefix):
    """A tiny random target saved as HF safetensors, plus an MTP module the way its family ships one:
    the `extra` tensors and a decoder layer under `prefix` (a noisy copy of target layer `layer`, in
    the checkpoint's own per-expert layout)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **settings))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    weights = load_file(path)
    generator = torch.Generator().manual_seed(1)
    source = f"model.layers.{layer}."
    for key in [key for key in weights if key.startswith(source)]:
        weights[prefix + key[len(source):]] = weights[key] + 0.05 * torch.randn(weights[key].shape, generator=generator)
    weights.update({key: make(weights, generator) for key, make in extra.items()})
    save_file(weights, path, metadata={"format": "pt"})
    return str(directory)


def noisy(base):
    return lambda weights, generator: base + 0.05 * torch.randn(TINY["hidden_size"], generator=generator)


def projection(weights, generator):
    return 0.1 * torch.randn(TINY["hidden_size"], 2 * TINY["hidden_size"], generator=generator)


DEEPSEEK_MTP = {  # DeepSeek-V3's layer N (here 2): its own embedding and shared head copies
    "model.layers.2.embed_tokens.weight": lambda weights, _: weights["model.embed_tokens.weight"].clone(),
    "model.layers.2.enorm.weight": noisy(1.0), "model.layers.2.hnorm.weight": noisy(1.0),
    "model.layers.2.eh_proj.weight": projection, "model.layers.2.shared_head.norm.weight": noisy(1.0),
    "model.layers.2.shared_head.head.weight": lambda weights, _: weights["lm_head.weight"].clone(),
}
QWEN3_NEXT_MTP = {  # Qwen3-Next's mtp.*: norms scale by (1 + weight)
    "mtp.fc.weight": projection, "mtp.pre_fc_norm_embedding.weight": noisy(0.0),
    "mtp.pre_fc_norm_hidden.weight": noisy(0.0), "mtp.norm.weight": noisy(0.0),
}


def target_from(directory, name):
    return load_target(OmegaConf.create({"name": name, "path": directory, "dtype": "float32", "draft_vocab_size": 512}))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, tiny_target):
    directory = synthetic_checkpoint(tmp_path_factory.mktemp("deepseek"), tiny_target.tokenizer, "deepseek_v3", DEEPSEEK,
                                     DEEPSEEK_MTP, 1, "model.layers.2.")
    return directory, target_from(directory, "tiny-deepseek-v3")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, tiny_target):
    directory = synthetic_checkpoint(tmp_path_factory.mktemp("qwen3_next"), tiny_target.tokenizer, "qwen3_next",
                                     QWEN3_NEXT, QWEN3_NEXT_MTP, 3, "mtp.layers.0.")
    return directory, target_from(directory, "tiny-qwen3-next")


@pytest.fixture(scope="module")
def llama(tiny_target):
    return distilled_setup(tiny_target)


@pytest.fixture(scope="module")
def trained(llama):
    """An MTP module after 40 real training steps (from scratch) on the target's own continuations."""
    return trained_on(mtp(llama[0], llama[2]), llama)


def test_step_weights_are_normalized_powers_of_0_6():
    assert normalized_decay(0.6, 3) == pytest.approx([1 / 1.96, 0.6 / 1.96, 0.36 / 1.96])
    assert compose_train(["drafter=mtp"]).drafter.loss_decay == 0.6


def test_from_scratch_shapes_and_what_it_shares_with_the_target(llama):
    target, batch, vocab = llama
    drafter = mtp(target, vocab)
    width, layers = target.spec.hidden_size, target.spec.num_layers
    assert drafter.capture_layers() == [layers]
    assert drafter.eh_proj.weight.shape == (width, 2 * width)
    assert type(drafter.block).__name__ == "LlamaDecoderLayer"
    last = target.decoder_layers[layers - 1].state_dict()  # the block starts as the target's last layer
    assert all(torch.equal(tensor, last[name]) for name, tensor in drafter.block.state_dict().items())
    assert torch.equal(drafter.lm_head.weight, target.lm_head_weight[vocab.draft_ids])
    assert torch.equal(drafter.norm.weight, target.model.model.norm.weight)
    frozen = [drafter.embed_tokens, drafter.lm_head, drafter.norm, drafter.target_norm]
    assert not any(p.requires_grad for module in frozen for p in module.parameters())
    assert drafter.hparams() == {"ttt_steps": 3, "loss_decay": 0.6, "draft_vocab_size": 512, "native_layout": None}
    captured = capture(target, vocab, batch, drafter.capture_layers())
    torch.testing.assert_close(drafter.fuse(captured.aux), captured.final)  # the target's final hidden state


def test_block_is_the_target_architecture(tiny_gemma3_target, deepseek, qwen3_next):
    gemma = mtp(tiny_gemma3_target, batch_vocab(tiny_gemma3_target, SOME_TOKENS))
    assert type(gemma.block).__name__ == "Gemma3DecoderLayer" and gemma.block.self_attn.sliding_window is None
    assert type(gemma.enorm).__name__ == "Gemma3RMSNorm"
    _, target = deepseek
    block = mtp(target, batch_vocab(target, SOME_TOKENS, 49152)).block
    assert type(block).__name__ == "DeepseekV3DecoderLayer" and block.mlp.experts.gate_up_proj.shape == (4, 32, 32)
    _, target = qwen3_next
    vocab = batch_vocab(target, SOME_TOKENS)
    drafter = mtp(target, vocab)
    assert type(drafter.block).__name__ == "Qwen3NextDecoderLayer" and drafter.block.block_type == "full_attention"
    # Qwen3-Next's final norm scales by (1 + weight) too: the frozen copy still gives its final state
    ids = torch.arange(1, 13).unsqueeze(0)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    captured = capture(target, vocab, batch, drafter.capture_layers())
    torch.testing.assert_close(drafter.fuse(captured.aux), captured.final)


def test_training_unrolls_what_serving_runs(llama):
    """Row t of unrolled step k (training-time test) equals the k-th chained draft step served from a
    DraftCache after committing tokens 0..t+1, teacher-forced."""
    target, batch, vocab = llama
    drafter = mtp(target, vocab)
    row = {name: tensor[:1] for name, tensor in batch.items()}
    ids = row["input_ids"]
    outputs = []
    hook = drafter.block.register_forward_hook(lambda _m, _args, out: outputs.append(out.detach()))
    try:
        captured = capture(target, vocab, row, drafter.capture_layers())
        drafter.loss(row, captured)
        steps = len(outputs)
        for t in (3, 17):
            cache = DraftCache()
            feature, _ = drafter.extend(cache, [state[:, : t + 1] for state in captured.aux], ids[:, 1 : t + 2])
            for k in range(1, steps):
                feature = drafter.step(cache, ids[:, t + 1 + k : t + 2 + k], feature, drafter.positions(cache.length, ids[:, :1]))
            for k in range(steps):
                torch.testing.assert_close(outputs[-steps + k][0, -1], outputs[k][0, t], msg=f"step {k}, t {t}")
    finally:
        hook.remove()


def test_loss_metrics_masks_and_gradients(llama):
    target, batch, vocab = llama
    drafter = mtp(target, vocab)
    captured = capture(target, vocab, batch, drafter.capture_layers())
    loss, metrics = drafter.loss(batch, captured)
    assert torch.isfinite(loss) and sorted(k for k in metrics if k.startswith("acc/")) == ["acc/1", "acc/2", "acc/3"]
    zero, _ = drafter.loss({**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}, captured)
    assert zero.item() == 0.0
    loss.backward()
    assert drafter.eh_proj.weight.grad is not None and drafter.block.self_attn.q_proj.weight.grad is not None
    assert drafter.hnorm.weight.grad is not None
    assert drafter.lm_head.weight.grad is None and drafter.norm.weight.grad is None and drafter.embed_tokens.weight.grad is None


def test_a_few_training_steps_learn(trained):
    _, history = trained
    (first_loss, first_acc), (last_loss, last_acc) = history[0], history[-1]
    assert last_loss < first_loss and last_acc > first_acc + 0.2


@pytest.mark.parametrize("draft", [dict(steps=3), dict(draft="tree", depth=3, topk=3, total=8)])
def test_trained_module_serves_losslessly_with_accepted_drafts(llama, trained, draft):
    target, batch, _ = llama
    # the random target's distributions are nearly flat: a third of its greedy tokens learnt is plenty
    assert lossless_accept_len(target, trained[0], batch["input_ids"][:, :8], 32, **draft) > 1.2


def test_native_deepseek_weights_are_read_from_the_checkpoint(deepseek):
    directory, target = deepseek
    checkpoint = load_file(os.path.join(directory, "model.safetensors"))
    drafter = mtp(target, batch_vocab(target, SOME_TOKENS, 49152), "drafter.native_mtp=true")
    assert drafter.hparams()["native_layout"] == "deepseek_v3"
    mtp_keys = {key: tensor for key, tensor in checkpoint.items() if key.startswith("model.layers.2.")}
    assert torch.equal(drafter.eh_proj.weight, mtp_keys["model.layers.2.eh_proj.weight"])
    assert torch.equal(drafter.norm.weight, mtp_keys["model.layers.2.shared_head.norm.weight"])
    assert torch.equal(drafter.block.self_attn.kv_b_proj.weight, mtp_keys["model.layers.2.self_attn.kv_b_proj.weight"])
    experts = drafter.block.mlp.experts
    for expert in range(4):  # HF fuses [gate ; up] per expert; the checkpoint keeps one tensor each
        gate, up = experts.gate_up_proj[expert].chunk(2)
        assert torch.equal(gate, mtp_keys[f"model.layers.2.mlp.experts.{expert}.gate_proj.weight"])
        assert torch.equal(up, mtp_keys[f"model.layers.2.mlp.experts.{expert}.up_proj.weight"])
        assert torch.equal(experts.down_proj[expert], mtp_keys[f"model.layers.2.mlp.experts.{expert}.down_proj.weight"])
    # not the target's last layer it would start from without native weights
    assert not torch.equal(drafter.block.self_attn.kv_b_proj.weight, checkpoint["model.layers.1.self_attn.kv_b_proj.weight"])


def saved_from(drafter, target, directory):
    target_cfg = {"name": target.spec.name, "path": directory}
    return SavedDrafter("mtp", drafter.hparams(), verifier_of(target.spec.to_dict(), target_cfg), target_cfg,
                        {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()},
                        {"draft": "chain", "steps": 3})


@pytest.mark.parametrize("family,prefix", [("deepseek", "model.layers.2."), ("qwen3_next", "mtp.")])
def test_native_fine_tune_writes_back_the_same_keys(request, tmp_path, family, prefix):
    """Fine-tune the native module a few steps, write it back (format=target_mtp): exactly the
    checkpoint's MTP keys and shapes; spliced into the checkpoint, the module reads back as trained."""
    directory, target = request.getfixturevalue(family)
    batch = self_distilled_batch(target, prompts=2, length=24)
    size = 49152 if family == "deepseek" else 512
    vocab = batch_vocab(target, batch, size)
    drafter = mtp(target, vocab, "drafter.native_mtp=true", f"drafter.draft_vocab_size={size}")
    before = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    history = train_steps(drafter, batch, capture(target, vocab, batch, drafter.capture_layers()), 4, lr=3e-3)
    assert history[-1][0] < history[0][0]
    assert not torch.equal(drafter.eh_proj.weight, before["eh_proj.weight"])

    out = tmp_path / "written"
    out.mkdir()
    formats.writer("target_mtp", "mtp").write_checked(saved_from(drafter, target, directory), str(out), "test")
    written = load_file(str(out / "model.safetensors"))
    original = {key: tensor for key, tensor in load_file(os.path.join(directory, "model.safetensors")).items()
                if key.startswith(prefix)}
    assert written.keys() == original.keys()
    assert all(written[key].shape == original[key].shape for key in original)

    spliced = tmp_path / "spliced"
    shutil.copytree(directory, spliced)
    save_file({**load_file(str(spliced / "model.safetensors")), **written}, str(spliced / "model.safetensors"),
              metadata={"format": "pt"})
    reloaded = mtp(target_from(str(spliced), target.spec.name), vocab, "drafter.native_mtp=true",
                   f"drafter.draft_vocab_size={size}")
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_target_mtp_artifact_imports_and_serves_losslessly(deepseek, tmp_path):
    """export.run's import of a target_mtp dir gives the same module, and it serves a MoE + MLA
    target losslessly, chain and tree."""
    directory, target = deepseek
    drafter = mtp(target, batch_vocab(target, SOME_TOKENS, 49152), "drafter.native_mtp=true")
    formats.writer("target_mtp", "mtp").write_checked(saved_from(drafter, target, directory), str(tmp_path), "test")
    config = json.loads((tmp_path / "config.json").read_text())
    context = formats.ImportFor(target, {"name": target.spec.name, "path": directory},
                                OmegaConf.to_container(compose_train(["drafter=mtp"]).drafter, resolve=True))
    imported = formats.reader(config, str(tmp_path)).read(str(tmp_path), config, context)
    assert all(torch.equal(imported.weights[name], tensor) for name, tensor in drafter.state_dict().items())
    native = tmp_path / "native"
    native.mkdir()
    write_native(imported, str(native))
    served = read(str(native)).build(str(native)).eval()
    prompts = self_distilled_batch(target, prompts=1, length=8)["input_ids"]
    lossless_accept_len(target, served, prompts, 20, steps=3)
    lossless_accept_len(target, served, prompts, 20, draft="tree", depth=3, topk=2, total=6)


def test_requirements_the_target_cannot_meet_fail_at_config_time(tiny_target, deepseek, tmp_path):
    vocab = batch_vocab(tiny_target, SOME_TOKENS)
    with pytest.raises(UserError, match="not loaded from a local HF dir") as error:
        mtp(tiny_target, vocab, "drafter.native_mtp=true")  # a random init: no checkpoint at all
    assert "\n" not in str(error.value)
    directory, target = deepseek
    bare = tmp_path / "bare"  # the same target without its MTP module
    shutil.copytree(directory, bare)
    save_file({key: tensor for key, tensor in load_file(str(bare / "model.safetensors")).items()
               if not key.startswith("model.layers.2.")}, str(bare / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"has no MTP weights \(looked for model.layers.2.eh_proj.weight"):
        mtp(target_from(str(bare), "bare"), batch_vocab(target, SOME_TOKENS, 49152), "drafter.native_mtp=true")
    with pytest.raises(UserError, match="set drafter.draft_vocab_size=49152"):
        mtp(target, batch_vocab(target, SOME_TOKENS), "drafter.native_mtp=true")
    with pytest.raises(UserError, match="trained from scratch"):
        scratch = mtp(tiny_target, vocab)
        formats.writer("target_mtp", "mtp").write_checked(saved_from(scratch, tiny_target, ""), str(tmp_path), "test")


@pytest.mark.slow
def test_smollm2_mtp_trains_and_is_lossless(smollm2_fp32_target):
    target = smollm2_fp32_target
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is a KV cache?"}], tokenize=False,
                                                add_generation_prompt=True)
    ids = target.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    batch = self_distilled_batch(target, prompts=1, length=40)
    vocab = batch_vocab(target, batch, 4096)
    drafter = mtp(target, vocab)
    assert type(drafter.block).__name__ == "LlamaDecoderLayer"
    history = train_steps(drafter, batch, capture(target, vocab, batch, drafter.capture_layers()), 3, lr=1e-3)
    assert history[-1][0] < history[0][0]
    drafter.eval()
    lossless_accept_len(target, drafter, ids, 16, steps=3)
    lossless_accept_len(target, drafter, ids, 16, draft="tree", depth=3, topk=3, total=8)
