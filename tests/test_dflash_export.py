"""DFlash and DSpark in the speculators (vLLM) format (export/formats/dflash.py): the config and
weights speculators 0.9.0 writes, the aux-layer-id translation vLLM applies, native and speculators
round trips that draft identically, and bad input refused in one line. (The real speculators
package: tests/interop/speculators_dflash.py.)"""

import json

import pytest
import torch
from conftest import (PROMPTS, VARIED_TARGET, chat_ids, compose_train, native_round_trip, run_export, vocab_over,
                      write_format)
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from drafters.base import build_drafter
from drafters.config.errors import UserError
from export import formats

RANK = 16  # a small Markov head keeps the files small


def cfg_of(name):
    return compose_train([*VARIED_TARGET, f"drafter={name}", *([f"drafter.markov_rank={RANK}"] if name == "dspark" else [])])


@pytest.fixture(scope="module")
def target(varied_target):
    return varied_target


@pytest.fixture(scope="module")
def ids(target):
    return chat_ids(target, PROMPTS[0])


@pytest.fixture(scope="module", params=["dflash", "dspark"])
def exported(request, target, ids, tmp_path_factory):
    """(drafter, its SavedDrafter, the speculators dir, its config.json, its weights)."""
    name, directory = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    drafter = build_drafter(cfg_of(name).drafter, target, vocab_over(target, list(range(5, 3000, 7)), 256)).eval()
    saved = native_round_trip(drafter, cfg_of(name).target, target, ids, directory / "native")
    saved.verifier["name_or_path"] = "org/tiny-llama"
    config, weights = write_format(saved, "speculators", directory / "speculators")
    return drafter, saved, directory / "speculators", OmegaConf.to_container(config), weights


def read_back(path, target, drafter="dflash"):
    """What `export.run checkpoint=<path> drafter=<drafter>` reads, for this in-memory target."""
    cfg = cfg_of(drafter)
    config = json.loads((path / "config.json").read_text())
    context = formats.ImportFor(target, OmegaConf.to_container(cfg.target, resolve=True),
                                OmegaConf.to_container(cfg.drafter, resolve=True))
    return formats.reader(config, str(path)).read(str(path), config, context)


def edited(path, tmp_path, config=None, weights=None):
    """A copy of the speculators dir at `path` with its config.json and/or weights edited."""
    out = tmp_path / "edited"
    out.mkdir(exist_ok=True)
    document = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    (config or (lambda c: None))(document)
    (weights or (lambda w: None))(tensors)
    (out / "config.json").write_text(json.dumps(document))
    save_file(tensors, out / "model.safetensors")
    return out


def test_config_is_what_speculators_writes(exported, target):
    drafter, _, _, config, _ = exported
    name, aux = drafter.name, drafter.capture_layers()
    assert config["speculators_model_type"] == name
    assert config["architectures"] == [{"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}[name]]
    assert config["draft_vocab_size"] == 256 and config["block_size"] == 8 and config["target_hidden_size"] == 64
    assert config["aux_hidden_state_layer_ids"] == aux == [1, 2, 3, 4, 5]  # speculators counts like us
    assert config["mask_token_id"] == target.spec.vocab_size - 1
    assert config["sample_from_anchor"] is False and config["sliding_window_non_causal"] is True  # vLLM: non-causal
    layer = config["transformer_layer_config"]
    assert {key: layer[key] for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size")} == {
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 49152}
    assert layer["rope_theta"] == layer["rope_parameters"]["rope_theta"] == 10000.0
    assert layer["tie_word_embeddings"] is False and layer["attention_bias"] is False and layer["hidden_act"] == "silu"
    assert config["speculators_config"] == {
        "algorithm": name, "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]},
    }
    heads = {"markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True}
    assert {key: config.get(key) for key in heads} == (heads if name == "dspark" else dict.fromkeys(heads))


def test_weights_are_ours_without_the_embedding(exported):
    drafter, _, _, _, weights = exported
    expected = {name: tensor.shape for name, tensor in drafter.state_dict().items() if name != "embed_tokens.weight"}
    assert {name: tensor.shape for name, tensor in weights.items()} == expected
    assert weights["fc.weight"].shape == (64, 5 * 64) and weights["lm_head.weight"].shape == (256, 64)
    assert weights["layers.1.self_attn.q_norm.weight"].shape == (16,) and "layers.1.mlp.down_proj.weight" in weights
    assert all(torch.equal(tensor, drafter.state_dict()[name]) for name, tensor in weights.items())
    if drafter.name == "dspark":
        assert weights["markov_head.markov_w1.weight"].shape == (49152, RANK)
        assert weights["markov_head.markov_w2.weight"].shape == (256, RANK)
        assert weights["confidence_head.proj.weight"].shape == (1, 64 + RANK)


def vllm_target_layer_ids(config: dict) -> list[int]:
    """vLLM's speculators config translation (transformers_utils/configs/speculators/algos.py,
    update_dflash): z-lab's `target_layer_ids` from speculators' aux ids."""
    return [i - 1 for i in config["aux_hidden_state_layer_ids"]]


def test_layer_ids_name_the_states_we_capture(exported, target, ids):
    drafter, _, _, config, _ = exported
    aux = drafter.capture_layers()
    assert config["dflash_config"] == {"mask_token_id": drafter.mask_token_id,
                                       "target_layer_ids": [i - 1 for i in aux]}
    assert config["dflash_config"]["target_layer_ids"] == vllm_target_layer_ids(config)
    # z-lab's DFlash reads hidden_states[layer_id + 1]: the very states our hooks capture
    with torch.no_grad():
        states = target.model(ids, output_hidden_states=True).hidden_states
        captured, _ = target.capture(ids, None, aux)
    for layer_id, ours in zip(config["dflash_config"]["target_layer_ids"], captured):
        torch.testing.assert_close(states[layer_id + 1], ours, rtol=0, atol=0)


def drafts(drafter, target, ids):
    aux, _ = target.capture(ids, None, drafter.capture_layers())
    return drafter.extend(drafter.new_cache(), aux, ids.roll(-1, 1))


def test_speculators_round_trip_is_bitwise(exported, target, ids):
    drafter, saved, path, _, _ = exported
    back = read_back(path, target, drafter.name)
    assert back.drafter == drafter.name and back.hparams == saved.hparams
    assert back.proposal["steps"] == 7 and back.verifier["name_or_path"] == "org/tiny-llama"
    assert back.weights.keys() == saved.weights.keys()
    assert all(torch.equal(back.weights[k], saved.weights[k]) for k in saved.weights)  # embedding: the target's
    rebuilt = back.build(str(path)).eval()
    for theirs, ours in zip(drafts(rebuilt, target, ids), drafts(drafter, target, ids)):
        assert torch.equal(theirs, ours)


def test_export_run_imports_it(exported, tmp_path):
    """The command line: import (no `drafter=`: the head's format says which, dspark.yaml builds on
    dflash.yaml), then back to speculators, the same files."""
    drafter, _, path, config, weights = exported
    line = run_export(checkpoint=path, format="native", target="tiny_llama",
                      out=tmp_path / "native", **{"+target.random_init.initializer_range": 0.3})
    assert "[1, 2, 3, 4, 5] (input of layer k)" in line and "verifier org/tiny-llama" in line
    run_export(checkpoint=tmp_path / "native", format="speculators", out=tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)


def test_z_lab_layer_ids_alone_are_read_as_output_of_layer_k(exported, target, tmp_path):
    drafter, _, path, _, _ = exported

    def z_lab_only(config):
        del config["aux_hidden_state_layer_ids"], config["mask_token_id"]
        config["dflash_config"] = {"mask_token_id": 7, "target_layer_ids": [0, 3, 6, 1, 2]}

    back = read_back(edited(path, tmp_path, config=z_lab_only), target, drafter.name)
    assert back.hparams["aux_layers"] == [1, 4, 7, 2, 3] and back.hparams["mask_token_id"] == 7


def refused(path, target, drafter, message):
    with pytest.raises(UserError, match=message) as error:
        read_back(path, target, drafter)
    assert "\n" not in str(error.value)


def test_bad_input_is_one_line(exported, target, tmp_path):
    drafter, saved, path, _, _ = exported
    name = drafter.name
    other = {"dflash": "dspark", "dspark": "dflash"}[name]
    refused(path, target, other, f"a speculators {name} head; import it with drafter={name} \\(not {other}\\)")
    refused(edited(path, tmp_path, config=lambda c: c.update(sample_from_anchor=True)), target, name,
            f"sample_from_anchor=true \\(the anchor slot drafts too\\); our {name} drafts from the mask slots only")
    refused(edited(path, tmp_path, weights=lambda w: w.update({"fc.weight": torch.zeros(64, 128)})), target, name,
            "wrong shapes \\['fc.weight \\[64, 128\\] \\(expected \\[64, 320\\]\\)'\\]")
    refused(edited(path, tmp_path, config=lambda c: c["transformer_layer_config"].update(num_hidden_layers=3)),
            target, name, "missing weights \\['layers.2.input_layernorm.weight', ")
    refused(edited(path, tmp_path, config=lambda c: c.update(block_size=1)), target, name,
            f"{name} hyper-parameter block_size=1: must be >= 2")
    refused(edited(path, tmp_path, config=lambda c: c["transformer_layer_config"].update(rope_theta=5e5,
                                                                                         rope_parameters=None)),
            target, name, "draft layer rope_parameters=.*500000.*the target tiny-llama")
    refused(edited(path, tmp_path, config=lambda c: c["transformer_layer_config"].update(model_type="llama")),
            target, name, "a 'llama' draft layer; our DFlash layer is Qwen3's")
    refused(edited(path, tmp_path, config=lambda c: c.update(aux_hidden_state_layer_ids=[1, 2, 3, 4, 9])),
            target, name, "out of range for target tiny-llama")
    refused(edited(path, tmp_path, config=lambda c: [c.pop("aux_hidden_state_layer_ids"), c.pop("dflash_config")]),
            target, name, "no aux_hidden_state_layer_ids \\(nor dflash_config's\\)")
    if name == "dspark":
        # speculators' DSpark samples from the anchor unless the config says otherwise
        refused(edited(path, tmp_path, config=lambda c: c.pop("sample_from_anchor")), target, name,
                "sample_from_anchor=true")
        refused(edited(path, tmp_path, config=lambda c: c.update(markov_head_type="gated")), target, name,
                "markov_head_type=gated: our DSpark has a vanilla Markov head")
        refused(edited(path, tmp_path, config=lambda c: c.update(markov_rank=8)), target, name,
                "wrong shapes \\['confidence_head.proj.weight \\[1, 80\\] \\(expected \\[1, 72\\]\\)'")
    saved.verifier["name_or_path"] = None
    with pytest.raises(UserError, match="format=speculators: vLLM loads the target from verifier.name_or_path"):
        write_format(saved, "speculators", tmp_path / "no-verifier")
    saved.verifier["name_or_path"] = "org/tiny-llama"
