import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from conftest import assert_lossless_on_smollm2, compose_train, distilled_setup
from drafters.base import build_drafter, capture, sim_accept_len
from drafters.config.errors import UserError
from drafters.eagle3 import default_aux_layers
from drafters.layers import UnrolledAttention, draft_layer_config, ttt_attention, ttt_attention_merged
from drafters.target.model import full_attention_rope
from drafters.target.vocab import build_draft_vocab


def random_vocab(target_vocab, size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, target_vocab, (4000,), generator=generator).tolist()
    return build_draft_vocab([(stream, [1] * len(stream))], target_vocab, size, {"test": seed})


@pytest.fixture(scope="module")
def setup(tiny_target):
    cfg = compose_train(["target=tiny_llama"]).drafter
    vocab = random_vocab(tiny_target.spec.vocab_size, 512)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, tiny_target, vocab)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, tiny_target.spec.vocab_size, (2, 24), generator=generator)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": torch.ones_like(input_ids),
    }
    return drafter, vocab, batch


def test_draft_layers_on_gemma3_rotate_like_its_full_attention_layers(tiny_gemma3_target):
    """Gemma 3 keeps a RoPE per attention kind (full: theta 1e6, sliding-window: 1e4). A draft layer
    attends over its whole context, so draft_layer_config (what every drafter's layer and rotary
    embedding, and the exported layer configs, are built from) takes the full-attention one."""
    spec, rotary = tiny_gemma3_target.spec, tiny_gemma3_target.model.model.rotary_emb
    assert spec.rope_parameters["full_attention"] != spec.rope_parameters["sliding_attention"]
    layer = draft_layer_config(spec)
    assert layer.rope_parameters == spec.rope_parameters["full_attention"]
    x, positions = torch.zeros(1, 6, spec.hidden_size), torch.arange(3, 9).unsqueeze(0)
    for ours, targets in zip(LlamaRotaryEmbedding(layer)(x, positions), full_attention_rope(rotary, x, positions)):
        torch.testing.assert_close(ours, targets)


def test_default_aux_layers_follow_eagle3():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(32) == [2, 16, 29]


def test_shapes_and_frozen_embedding(setup, tiny_target):
    drafter, vocab, _ = setup
    width = tiny_target.spec.hidden_size
    assert drafter.fc.weight.shape == (width, 3 * width)
    assert drafter.midlayer.self_attn.q_proj.weight.shape[1] == 2 * width
    assert drafter.lm_head.weight.shape == (vocab.draft_size, width)
    assert not drafter.embed_tokens.weight.requires_grad
    assert torch.equal(drafter.embed_tokens.weight, tiny_target.embed_weight.float())
    # the head starts as the target's own rows of the draft vocabulary
    assert torch.equal(drafter.lm_head.weight, tiny_target.lm_head_weight[vocab.draft_ids].float())
    assert torch.equal(drafter.d2t, vocab.d2t) and torch.equal(drafter.t2d, vocab.t2d)


def test_capture_matches_hidden_states_convention(setup, tiny_target):
    _, vocab, batch = setup
    layers = [0, 2, 5, tiny_target.spec.num_layers]
    aux, final = tiny_target.capture(batch["input_ids"], batch["attention_mask"], layers)
    reference = tiny_target.model(batch["input_ids"], output_hidden_states=True)
    for k, tensor in zip(layers[:-1], aux):
        torch.testing.assert_close(tensor, reference.hidden_states[k])  # input of layer k
    # the last hidden state HF reports is post-norm; ours for k == N is the pre-norm layer output
    torch.testing.assert_close(tiny_target.model.model.norm(aux[-1]), reference.hidden_states[-1])
    torch.testing.assert_close(final, reference.hidden_states[-1])
    captured = capture(tiny_target, vocab, batch, layers)
    # the teacher at teacher positions (the next token is trained on), zero where nothing reads it
    taught = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1)).bool()
    assert taught.any() and not taught.all()
    full = reference.logits
    torch.testing.assert_close(captured.teacher_logits[taught], full[..., vocab.draft_ids][taught])
    assert not captured.teacher_logits[~taught].any() and not captured.in_vocab[~taught].any()
    greedy = full.argmax(-1)
    assert torch.equal(captured.in_vocab[taught], vocab.t2d[greedy][taught])
    where = captured.in_vocab
    assert torch.equal(vocab.draft_ids[captured.teacher_token[where]], greedy[where])


def test_aux_layers_out_of_range_is_user_error(tiny_target):
    cfg = compose_train(["target=tiny_llama", "drafter.aux_layers=[1,2,99]"]).drafter
    with pytest.raises(UserError, match="out of range"):
        build_drafter(cfg, tiny_target, random_vocab(tiny_target.spec.vocab_size, 64))


def ttt_attention_reference(q, keys, values):
    """TTT attention written out: step 0's scores causal, step j >= 1's only on the diagonal, one softmax."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    context = (q @ keys[0].transpose(-1, -2)) * scale
    context = context.masked_fill(~causal, torch.finfo(context.dtype).min)
    chain = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    weights = torch.softmax(torch.cat([context, *chain], -1).float(), -1).to(q.dtype)
    out = weights[..., :length] @ values[0]
    for j, v in enumerate(values[1:]):
        out = out + weights[..., length + j : length + j + 1] * v
    return out


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_ttt_attention_matches_explicit_mask(steps):
    generator = torch.Generator().manual_seed(steps)
    shape = (2, 3, 7, 8)
    q = torch.randn(shape, generator=generator)
    keys = [torch.randn(shape, generator=generator) for _ in range(steps)]
    values = [torch.randn(shape, generator=generator) for _ in range(steps)]
    torch.testing.assert_close(ttt_attention_reference(q, keys, values), ttt_attention_merged(q, keys, values))


@pytest.mark.parametrize("fused_attention", [ttt_attention, ttt_attention_merged], ids=["cpu_flash", "merged_mask"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_fused_ttt_attention_matches_reference_with_gradients(steps, dtype, tol, fused_attention):
    """Both fused paths (the CPU flash merge; the merged mask GPUs run) against the reference."""
    generator = torch.Generator().manual_seed(10 + steps)
    make = lambda: torch.randn(2, 3, 29, 16, generator=generator).to(dtype).requires_grad_()  # noqa: E731
    q, keys, values = make(), [make() for _ in range(steps)], [make() for _ in range(steps)]
    fused, reference = fused_attention(q, keys, values), ttt_attention_reference(q, keys, values)
    torch.testing.assert_close(fused, reference, atol=tol, rtol=tol)
    weight = torch.randn(fused.shape, generator=generator).to(dtype)
    inputs = [q, *keys, *values]
    for got, want in zip(torch.autograd.grad((fused * weight).sum(), inputs),
                         torch.autograd.grad((reference * weight).sum(), inputs)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_ttt_unrolling_is_causal(setup, tiny_target):
    """Changing token j may only affect the features of steps whose inputs reach token j: step k at
    position t reads tokens <= t+1+k, so everything with t + 1 + k < j must stay identical."""
    drafter, vocab, batch = setup
    j = 15
    outputs = []
    for change in (False, True):
        ids = batch["input_ids"].clone()
        if change:
            ids[:, j] = (ids[:, j] + 1) % tiny_target.spec.vocab_size
        features = []
        hook = drafter.midlayer.register_forward_hook(lambda _m, _args, out: features.append(out.detach()))
        try:
            b = {**batch, "input_ids": ids}
            drafter.loss(b, capture(tiny_target, vocab, b, drafter.capture_layers()))
        finally:
            hook.remove()
        outputs.append(features)
    for k, (before, after) in enumerate(zip(*outputs)):
        unaffected = j - 1 - k  # positions t < j - 1 - k
        torch.testing.assert_close(before[:, :unaffected], after[:, :unaffected], msg=f"step {k}")
        assert not torch.allclose(before[:, unaffected:], after[:, unaffected:]), f"step {k} ignores token {j}"


def test_loss_metrics_and_masking(varied_target):
    # a self-distilled batch: its teacher tokens are in the draft vocabulary, so every position trains
    _, batch, vocab = distilled_setup(varied_target)
    torch.manual_seed(0)
    drafter = build_drafter(compose_train(["target=tiny_llama"]).drafter, varied_target, vocab)
    captured = capture(varied_target, vocab, batch, drafter.capture_layers())
    loss, metrics = drafter.loss(batch, captured)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    assert sorted(k for k in metrics if k.startswith("acc/")) == [f"acc/{k}" for k in range(1, 4)]  # the default unroll: 3
    assert all(0.0 <= metrics[f"acc/{k}"] <= 1.0 for k in range(1, 4))
    # masking every assistant token leaves nothing to learn: zero loss
    empty = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    zero, _ = drafter.loss(empty, captured)
    assert zero.item() == 0.0
    loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.embed_tokens.weight.grad is None
    drafter.zero_grad()


def test_sim_accept_len():
    assert sim_accept_len([]) == 1.0
    assert sim_accept_len([1.0, 1.0, 1.0]) == 4.0
    assert sim_accept_len([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.slow
def test_smollm2_capture_and_teacher(smollm2_target):
    """On the real SmolLM2-135M: hooks read HF's hidden_states[k], the chunked greedy token is the
    full-vocabulary argmax, and an EAGLE-3 head builds on its 30 layers with aux [2, 15, 27]."""
    target = smollm2_target
    assert (target.spec.num_layers, target.spec.hidden_size, target.spec.vocab_size) == (30, 576, 49152)
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is a KV cache?"}],
                                                tokenize=False, add_generation_prompt=True)
    ids = target.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    layers = default_aux_layers(30)
    aux, final = target.capture(ids, torch.ones_like(ids), layers)
    with torch.no_grad():
        reference = target.model(ids, output_hidden_states=True)
    for k, tensor in zip(layers, aux):
        assert torch.equal(tensor, reference.hidden_states[k])
    assert torch.equal(target.argmax(final, chunk=5000), reference.logits.argmax(-1))
    vocab = random_vocab(target.spec.vocab_size, 1024)
    drafter = build_drafter(compose_train().drafter, target, vocab)
    assert drafter.capture_layers() == [2, 15, 27]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss, metrics = drafter.loss(batch, capture(target, vocab, batch, layers))
    assert torch.isfinite(loss) and "acc/3" in metrics


@pytest.mark.slow
def test_smollm2_tree_is_lossless_in_float32(smollm2_fp32_target):
    """EAGLE-2's dynamic tree under an EAGLE-3 head on the real SmolLM2-135M: the greedy output is plain decoding's."""
    assert_lossless_on_smollm2(smollm2_fp32_target, "eagle3", dict(draft="tree", depth=4, topk=4, total=16))


def test_fc_norm_makes_the_fused_feature_blind_to_each_states_scale(tiny_target):
    """`drafter.fc_norm` (EAGLE 3.1) norms each target state before fc: scaling one state by a
    constant leaves the draft input as it was; without the norms it moves."""
    vocab = random_vocab(tiny_target.spec.vocab_size, 512)
    generator = torch.Generator().manual_seed(2)
    aux = [torch.randn(1, 5, tiny_target.spec.hidden_size, generator=generator) for _ in range(3)]
    scaled = [aux[0] * 7.0, *aux[1:]]
    for fc_norm in (True, False):
        torch.manual_seed(0)
        # a random fc: a warm-started one reads the last state alone
        overrides = ["target=tiny_llama", f"drafter.fc_norm={fc_norm}", "drafter.init_layer_from_target=false"]
        drafter = build_drafter(compose_train(overrides).drafter, tiny_target, vocab)
        assert len(drafter.fc_norm) == (3 if fc_norm else 0)
        same = torch.allclose(drafter.fuse(aux), drafter.fuse(scaled), atol=1e-5)
        assert same == fc_norm
        assert ("fc_norm.0.weight" in drafter.state_dict()) == fc_norm


def test_feature_noise_perturbs_training_only(varied_target):
    """`drafter.feature_noise` adds uniform noise to the unroll's input in training; evaluation and a
    width of 0 compute the noiseless loss."""
    _, batch, vocab = distilled_setup(varied_target)
    losses = {}
    for noise in (0.0, 0.2):
        torch.manual_seed(0)
        drafter = build_drafter(compose_train(["target=tiny_llama", f"drafter.feature_noise={noise}"]).drafter,
                                varied_target, vocab)
        captured = capture(varied_target, vocab, batch, drafter.capture_layers())
        for mode in ("train", "eval"):
            getattr(drafter, mode)()
            with torch.no_grad():
                losses[noise, mode] = float(drafter.loss(batch, captured)[0])
    assert losses[0.0, "eval"] > 0
    assert losses[0.0, "train"] == losses[0.0, "eval"] == losses[0.2, "eval"]
    assert losses[0.2, "train"] != losses[0.0, "train"]
    assert "feature_noise" not in drafter.hparams()  # a training choice: the artifact does not record it


def test_layer_warm_start_computes_the_targets_last_layer(tiny_target, tiny_gemma3_target):
    """`drafter.init_layer_from_target` (by default: null, where the shapes allow): at the start the
    draft layer is the target's last decoder layer applied to the feature (the embedding half of its
    attention input is zero), and fc picks the highest target state; a target whose last layer is not
    Llama-shaped starts a fresh layer by default and is refused when asked for it."""
    vocab = random_vocab(tiny_target.spec.vocab_size, 512)
    cfg = compose_train(["target=tiny_llama"]).drafter
    drafter = build_drafter(cfg, tiny_target, vocab)
    generator = torch.Generator().manual_seed(4)
    aux = [torch.randn(1, 6, tiny_target.spec.hidden_size, generator=generator) for _ in range(3)]
    feature = drafter.fuse(aux)
    torch.testing.assert_close(feature, aux[-1])
    tokens = torch.randint(0, tiny_target.spec.vocab_size, (1, 6), generator=generator)
    positions = torch.arange(6).unsqueeze(0)
    cos, sin = drafter.rotary(feature, positions)
    with torch.no_grad():
        ours = drafter.midlayer(drafter.embed_tokens(tokens), feature, cos, sin, UnrolledAttention())
        theirs = tiny_target.decoder_layers[-1](feature, position_embeddings=(cos, sin), position_ids=positions)
    torch.testing.assert_close(ours, theirs[0] if isinstance(theirs, tuple) else theirs, atol=1e-5, rtol=1e-4)
    fresh = build_drafter(compose_train(["target=tiny_llama", "drafter.init_layer_from_target=false"]).drafter,
                          tiny_target, vocab)
    assert not torch.allclose(fresh.fuse(aux), aux[-1], atol=1e-3)
    gemma_vocab = random_vocab(tiny_gemma3_target.spec.vocab_size, 256)
    gemma = build_drafter(compose_train(["target=tiny_llama"]).drafter, tiny_gemma3_target, gemma_vocab)
    assert not torch.equal(gemma.fc.weight[:, -tiny_gemma3_target.spec.hidden_size:],
                           torch.eye(tiny_gemma3_target.spec.hidden_size))
    gemma_cfg = compose_train(["target=tiny_llama", "drafter.init_layer_from_target=true"]).drafter
    with pytest.raises(UserError, match="drafter.init_layer_from_target: the last layer of target .* is not a Llama layer"):
        build_drafter(gemma_cfg, tiny_gemma3_target, gemma_vocab)
