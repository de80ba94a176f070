"""drafter=gemma_mtp: the assistant reads the target's KV cache (the last full-attention layer's),
trains on exactly the keys/values it reads when serving, drafts chains and trees from the engine's
cache, and serving stays lossless."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from conftest import (batch_vocab, compose_train, distilled_setup, lossless_accept_len, self_distilled_batch,
                      train_steps, trained_on)
from drafters.base import build_drafter, capture
from drafters.config.errors import UserError
from drafters.storage.artifact import SavedDrafter, read, verifier_of, write_native
from drafters.target.model import Target
from serving.engine import generate_spec

SOME_TOKENS = {"input_ids": torch.arange(8)}


def assistant(target, vocab, *overrides):
    torch.manual_seed(0)
    return build_drafter(compose_train(["drafter=gemma_mtp", *overrides]).drafter, target, vocab)


@pytest.fixture(scope="module")
def gemma(tiny_gemma3_target):
    return distilled_setup(tiny_gemma3_target)


@pytest.fixture(scope="module")
def trained(gemma):
    """An assistant after 40 real training steps on the target's own continuations, and its history."""
    return trained_on(assistant(gemma[0], gemma[2]), gemma)


def test_shapes_and_what_it_shares_with_the_target(gemma):
    target, batch, vocab = gemma
    drafter = assistant(target, vocab)
    width = target.spec.hidden_size  # 64; the assistant is half as wide by default
    assert drafter.kv_layer == 1 and drafter.capture_layers() == [1, 4]  # its only full-attention layer; the top
    assert drafter.pre_projection.weight.shape == (width // 2, 2 * width)
    assert drafter.post_projection.weight.shape == (width, width // 2)
    assert len(drafter.layers) == 2
    # queries in the target's head size, as many heads as the target's
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (4 * 16, width // 2)
    # logits through the target's tied embedding (draft rows), its input scaled like Gemma's
    assert torch.equal(drafter.lm_head.weight, target.embed_weight[vocab.draft_ids].float())
    assert drafter.embed_scale.item() == pytest.approx(math.sqrt(width), rel=1e-2)
    assert not any(p.requires_grad for p in [drafter.embed_tokens.weight, drafter.lm_head.weight,
                                             drafter.target_norm.weight])
    # the frozen copy of Gemma's (1 + weight) final norm gives the target's final hidden state
    captured = capture(target, vocab, batch, drafter.capture_layers())
    torch.testing.assert_close(drafter.fuse(captured.aux), captured.final)


def test_training_reads_the_keys_values_the_engine_cache_holds(gemma):
    target, batch, vocab = gemma
    drafter = assistant(target, vocab)
    ids = batch["input_ids"][:1]
    aux, _ = target.capture(ids, None, drafter.capture_layers())
    keys, values = drafter.target_keys_values(aux[0])
    cache = DynamicCache()
    target.capture(ids, None, [], cache=cache)
    torch.testing.assert_close(keys, cache.layers[1].keys)
    torch.testing.assert_close(values, cache.layers[1].values)


def test_a_training_step_is_a_serving_step(gemma):
    """Row t of unrolled step k in training computes what serving computes for the k-th draft after
    committing tokens 0..t+1 (teacher-forced): same keys/values, same constant query position."""
    target, batch, vocab = gemma
    drafter = assistant(target, vocab)
    row = {name: tensor[:1] for name, tensor in batch.items()}
    ids = row["input_ids"]
    outputs = []
    hook = drafter.post_projection.register_forward_hook(lambda _m, _args, out: outputs.append(out.detach()))
    try:
        drafter.loss(row, capture(target, vocab, row, drafter.capture_layers()))
        steps = len(outputs)
        for t in (5, 20):
            outputs_before = len(outputs)
            cache = DynamicCache()
            aux, _ = target.capture(ids[:, : t + 1], None, drafter.capture_layers(), cache=cache)
            context = drafter.new_cache(cache)
            feature, _ = drafter.extend(context, aux, ids[:, 1 : t + 2])
            for k in range(1, steps):
                feature = drafter.step(context, ids[:, t + 1 + k : t + 2 + k], feature)
            assert context.length == t + 1  # drafting wrote nothing
            for k in range(steps):
                torch.testing.assert_close(outputs[outputs_before + k][0, -1], outputs[k][0, t], msg=f"step {k}, t {t}")
    finally:
        hook.remove()


def test_loss_metrics_masks_and_gradients(gemma):
    target, batch, vocab = gemma
    drafter = assistant(target, vocab)
    captured = capture(target, vocab, batch, drafter.capture_layers())
    loss, metrics = drafter.loss(batch, captured)
    assert torch.isfinite(loss) and sorted(k for k in metrics if k.startswith("acc/")) == ["acc/1", "acc/2", "acc/3", "acc/4"]
    zero, _ = drafter.loss({**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}, captured)
    assert zero.item() == 0.0
    loss.backward()
    assert drafter.pre_projection.weight.grad is not None and drafter.layers[1].self_attn.q_proj.weight.grad is not None
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None


def test_a_few_training_steps_learn(trained):
    _, history = trained
    (first_loss, first_acc), (last_loss, last_acc) = history[0], history[-1]
    assert last_loss < first_loss and last_acc > first_acc + 0.2


@pytest.mark.parametrize("draft", [dict(steps=4), dict(draft="tree", depth=4, topk=3, total=10)])
def test_trained_assistant_serves_losslessly_with_accepted_drafts(gemma, trained, draft):
    """Prompts longer than the sliding window, drafts accepted (so caches are cropped and, for trees,
    compacted): the output stays the target's own greedy output."""
    target, batch, _ = gemma
    # the random target's distributions are nearly flat: a third of its greedy tokens learnt is plenty
    assert lossless_accept_len(target, trained[0], batch["input_ids"][:, :8], 32, **draft) > 1.2


@pytest.mark.parametrize("draft", [dict(steps=3), dict(draft="tree", depth=4, topk=3, total=10)])
def test_untrained_assistant_on_a_llama_target_is_lossless(tiny_target, draft):
    batch = self_distilled_batch(tiny_target, prompts=2, length=12)
    drafter = assistant(tiny_target, batch_vocab(tiny_target, batch)).eval()
    assert drafter.capture_layers() == [7, 8]  # every Llama layer is full attention: the last one's cache
    lossless_accept_len(tiny_target, drafter, batch["input_ids"][:, :8], 24, **draft)


def test_native_artifact_round_trip(gemma, trained, tmp_path):
    target, batch, _ = gemma
    drafter, _ = trained
    target_cfg = {"name": target.spec.name}
    saved = SavedDrafter("gemma_mtp", drafter.hparams(), verifier_of(target.spec.to_dict(), target_cfg), target_cfg,
                         {name: tensor.clone() for name, tensor in drafter.state_dict().items()}, {"draft": "chain", "steps": 4})
    write_native(saved, str(tmp_path))
    rebuilt = read(str(tmp_path)).build(str(tmp_path)).eval()
    assert rebuilt.kv_layer == drafter.kv_layer and rebuilt.embed_scale == drafter.embed_scale
    prompt = batch["input_ids"][:1, :8]
    assert generate_spec(target, rebuilt, prompt, 16, set())[0] == generate_spec(target, drafter, prompt, 16, set())[0]
    assert generate_spec(target, rebuilt, prompt, 16, set())[1].accept_len == \
        generate_spec(target, drafter, prompt, 16, set())[1].accept_len


def meta_target(tokenizer, model_type, **settings):
    """A target of this architecture on the meta device: its spec, no weights."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings))
    return Target(model, tokenizer, f"tiny-{model_type}", "meta")


TINY = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)


@pytest.mark.parametrize("model_type,settings,reason", [
    ("deepseek_v3", dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         moe_intermediate_size=16), "multi-head latent attention"),
    ("qwen3_next", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, linear_num_value_heads=2, linear_num_key_heads=2,
                        linear_key_head_dim=8, linear_value_head_dim=8), "partial_rotary_factor=0.25"),
    ("gemma3_text", dict(num_key_value_heads=1, head_dim=8, layer_types=["sliding_attention"] * 4), "no full-attention layer"),
])
def test_targets_whose_cache_it_cannot_read_fail_at_config_time(tiny_target, model_type, settings, reason):
    target = meta_target(tiny_target.tokenizer, model_type, **TINY, **settings)
    with pytest.raises(UserError, match=reason) as error:
        build_drafter(compose_train(["drafter=gemma_mtp"]).drafter, target, batch_vocab(tiny_target, SOME_TOKENS))
    assert "\n" not in str(error.value)


def test_bad_settings_and_missing_cache_are_clear(tiny_target):
    vocab = batch_vocab(tiny_target, SOME_TOKENS)
    with pytest.raises(UserError, match="multiple of the target's 2 KV heads"):
        assistant(tiny_target, vocab, "drafter.num_heads=3")
    with pytest.raises(ValueError, match="needs it"):
        assistant(tiny_target, vocab).new_cache()


@pytest.mark.slow
def test_smollm2_assistant_is_lossless(smollm2_fp32_target):
    target = smollm2_fp32_target
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is a KV cache?"}], tokenize=False,
                                                add_generation_prompt=True)
    ids = target.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    drafter = assistant(target, batch_vocab(target, {"input_ids": torch.arange(4096)}, 4096)).eval()
    lossless_accept_len(target, drafter, ids, 16, steps=4)
    lossless_accept_len(target, drafter, ids, 16, draft="tree", depth=3, topk=3, total=8)


@pytest.mark.slow
def test_gemma3_270m_assistant_reads_layer_17_trains_and_is_lossless():
    """target=gemma: the embedded Gemma 3 270M (a base model, given a plain-text template), in float32
    so that greedy serving is token-for-token plain decoding."""
    from drafters.target.model import load_target

    target = load_target(compose_train(["target=gemma", "target.dtype=float32"]).target)
    assert target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True) == "<bos>User: Hi\nAssistant:"
    batch = self_distilled_batch(target, prompts=2, length=24)
    vocab = batch_vocab(target, batch, 2048)
    drafter = assistant(target, vocab)
    assert drafter.capture_layers() == [17, 18]  # its last full-attention layer; the top
    aux, _ = target.capture(batch["input_ids"][:1], None, drafter.capture_layers())
    cache = DynamicCache()
    target.capture(batch["input_ids"][:1], None, [], cache=cache)
    torch.testing.assert_close(drafter.target_keys_values(aux[0])[0], cache.layers[17].keys)
    history = train_steps(drafter, batch, capture(target, vocab, batch, drafter.capture_layers()), 3, lr=1e-3)
    assert history[-1][0] < history[0][0]
    drafter.eval()
    lossless_accept_len(target, drafter, batch["input_ids"][:1, :8], 16, steps=3)
    lossless_accept_len(target, drafter, batch["input_ids"][:1, :8], 16, draft="tree", depth=3, topk=3, total=8)
