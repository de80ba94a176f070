"""export.run: native / speculators / sglang artifacts of a tiny trained checkpoint, their round
trips, imports of other engines' EAGLE-3 layouts, the aux-layer-id translation, bad inputs, atomic
writes, and `drafter.init_from` in training. (vLLM's speculators package itself: tests/interop/.)"""

import json
import os
import shutil
import subprocess
import sys
import typing

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from conftest import compose_train, random_drafter, run_export, vocab_over
from drafters.base import build_drafter, drafter_class
from drafters.config import settings
from drafters.config.errors import UserError
from drafters.storage import artifact
from drafters.storage.artifact import default_proposal
from drafters.storage.writes import MARK_FILE
from drafters.target.model import load_target
from export.layer_ids import translate_layer_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "Speculative decoding drafts tokens with a small head and verifies them with the target."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    result = subprocess.run(
        [sys.executable, "-m", "training.run", "target=tiny_llama", "logger=none", "data.max_samples=24",
         "data.max_length=96", "trainer.batch_size=2", "trainer.max_steps=1", "trainer.eval_max_samples=2",
         f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return str(run_dir / "checkpoints" / "latest")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "export.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def draft_logits(path, target):
    """Last-position draft logits of the artifact at `path` on a fixed text, loaded as serving loads it."""
    _, drafter = artifact.load(path, target=target)
    ids = target.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    aux, _ = target.capture(ids, None, drafter.capture_layers())
    return drafter.extend(drafter.new_cache(), aux, torch.cat([ids[:, 1:], ids[:, :1]], 1))[1]


def files(path):
    with open(os.path.join(path, "config.json")) as handle:
        return json.load(handle), load_file(os.path.join(path, "model.safetensors"))


def edited_copy(source, destination, weights=None, state=None):
    """A copy of a checkpoint dir with its weights and/or trainer state edited."""
    shutil.copytree(source, destination)
    if weights:
        tensors = load_file(os.path.join(destination, "model.safetensors"))
        weights(tensors)
        save_file(tensors, os.path.join(destination, "model.safetensors"))
    if state:
        with open(os.path.join(destination, "trainer_state.json")) as handle:
            document = json.load(handle)
        state(document)
        with open(os.path.join(destination, "trainer_state.json"), "w") as handle:
            json.dump(document, handle)
    return str(destination)


def test_layer_id_translation_both_ways():
    ours = [0, 2, 15, 27, 30]
    theirs = translate_layer_ids(ours, "input", "output")
    assert theirs == [-1, 1, 14, 26, 29]  # the state entering layer k left layer k-1
    assert translate_layer_ids(theirs, "output", "input") == ours
    assert translate_layer_ids(ours, "input", "input") == ours


def test_native_artifact_serves_like_its_checkpoint(checkpoint, tiny_target, tmp_path):
    line = run_export(checkpoint=checkpoint, format="native", out=tmp_path / "native")
    assert line.startswith(f"wrote native artifact {tmp_path / 'native'}") and "[2, 4, 5]" in line
    config, weights = files(tmp_path / "native")
    assert config["format"] == "specdraft" and config["drafter"] == "eagle3"
    assert config["hparams"]["aux_layers"] == [2, 4, 5]
    assert config["aux_layer_convention"].startswith("input of layer k")
    verifier = {key: config["verifier"][key] for key in ("hidden_size", "vocab_size", "num_layers", "architecture")}
    assert verifier == {"hidden_size": 64, "vocab_size": 49152, "num_layers": 8, "architecture": "LlamaForCausalLM"}
    assert config["proposal"] == {"draft": "chain", "steps": 3}  # the unroll it was trained for (the default)
    stored = load_file(os.path.join(checkpoint, "model.safetensors"))
    assert weights.keys() == stored.keys() and all(torch.equal(weights[k], stored[k]) for k in stored)
    assert torch.equal(draft_logits(str(tmp_path / "native"), tiny_target), draft_logits(checkpoint, tiny_target))
    served = subprocess.run([sys.executable, "-m", "serving.run", f"artifact={tmp_path / 'native'}", "max_new_tokens=6",
                             "dtype=float32", "prompt=Hello"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert served.returncode == 0, served.stderr[-2000:]
    assert " steps=3:" in served.stdout  # the unroll it was trained for


def test_serving_drafts_the_steps_an_artifact_records(checkpoint, tiny_target, tmp_path):
    run_export(checkpoint=checkpoint, format="native", out=tmp_path / "two", steps=2)
    assert files(tmp_path / "two")[0]["proposal"] == {"draft": "chain", "steps": 2}
    assert artifact.load(str(tmp_path / "two"), target=tiny_target)[1].proposal_steps == 2
    served = subprocess.run([sys.executable, "-m", "serving.run", f"artifact={tmp_path / 'two'}", "max_new_tokens=6",
                             "dtype=float32", "prompt=Hello", "compare_plain=false"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert served.returncode == 0, served.stderr[-2000:]
    assert " steps=2:" in served.stdout


def test_native_artifact_for_another_target_is_refused(checkpoint, tmp_path):
    run_export(checkpoint=checkpoint, format="native", out=tmp_path / "native")
    other = load_target(compose_train(["target=tiny_llama", "target.random_init.hidden_size=32",
                                       "target.random_init.head_dim=8"]).target)
    with pytest.raises(UserError, match="made for target tiny-llama \\(hidden_size=64\\).*has hidden_size=32"):
        artifact.load(str(tmp_path / "native"), target=other)


def test_speculators_layout(checkpoint, tmp_path):
    run_export(checkpoint=checkpoint, format="speculators", out=tmp_path / "spec", verifier="org/tiny-llama", steps=3)
    config, weights = files(tmp_path / "spec")
    assert config["architectures"] == ["Eagle3DraftModel"] and config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # speculators/vLLM count like us
    assert config["draft_vocab_size"] == 2048 and config["target_hidden_size"] == 64
    # what our layer computes: norms inside the layer only, raw residual, pre-norm feedback
    assert not any(config[flag] for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["head_dim"] == 16
    assert layer["vocab_size"] == 49152 and layer["rope_theta"] == 10000.0 and layer["tie_word_embeddings"] is False
    assert config["speculators_config"] == {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]},
    }
    assert {name for name in weights if not name.startswith("layers.0.")} == \
        {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"}
    assert "layers.0.self_attn.q_proj.weight" in weights and "layers.0.hidden_norm.weight" in weights
    assert weights["fc.weight"].shape == (64, 3 * 64) and weights["lm_head.weight"].shape == (2048, 64)


def test_sglang_layout(checkpoint, tmp_path):
    run_export(checkpoint=checkpoint, format="sglang", out=tmp_path / "sglang")
    config, weights = files(tmp_path / "sglang")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # ours [2, 4, 5] minus 1
    assert config["draft_vocab_size"] == 2048 and config["tie_word_embeddings"] is False
    assert "embed_tokens.weight" not in weights  # SGLang gives the draft the target's embedding
    assert {name for name in weights if not name.startswith("midlayer.")} == \
        {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_round_trip_through_other_formats_is_bitwise(checkpoint, tiny_target, tmp_path, fmt):
    run_export(checkpoint=checkpoint, format="native", out=tmp_path / "native")
    run_export(checkpoint=tmp_path / "native", format=fmt, out=tmp_path / fmt, verifier="org/tiny-llama")
    line = run_export(checkpoint=tmp_path / fmt, format="native", target="tiny_llama", out=tmp_path / "back")
    assert "[2, 4, 5]" in line
    (config, weights), (back_config, back_weights) = files(tmp_path / "native"), files(tmp_path / "back")
    assert weights.keys() == back_weights.keys()
    assert all(torch.equal(weights[k], back_weights[k]) and weights[k].dtype == back_weights[k].dtype for k in weights)
    assert back_config["hparams"] == config["hparams"] and back_config["drafter"] == "eagle3"
    assert torch.equal(draft_logits(str(tmp_path / "back"), tiny_target), draft_logits(checkpoint, tiny_target))


def test_fc_norm_heads_go_through_speculators_and_not_sglang(checkpoint, tiny_target, tmp_path):
    """`drafter.fc_norm` (EAGLE 3.1): speculators' flag of that name and its `fc_norm.{i}` weights
    round-trip bitwise; SGLang's EAGLE-3 computes no such norm, so format=sglang refuses the head."""
    def add_norms(weights):
        generator = torch.Generator().manual_seed(3)
        for i in range(3):
            weights[f"fc_norm.{i}.weight"] = 1 + torch.rand(weights["norm.weight"].shape, generator=generator)

    normed = edited_copy(checkpoint, tmp_path / "normed", weights=add_norms,
                         state=lambda s: s["hparams"].update(fc_norm=True))
    assert not torch.equal(draft_logits(normed, tiny_target), draft_logits(checkpoint, tiny_target))
    run_export(checkpoint=normed, format="speculators", out=tmp_path / "spec", verifier="org/tiny-llama")
    config, weights = files(tmp_path / "spec")
    assert config["fc_norm"] is True and {f"fc_norm.{i}.weight" for i in range(3)} <= weights.keys()
    run_export(checkpoint=tmp_path / "spec", format="native", target="tiny_llama", out=tmp_path / "back")
    assert files(tmp_path / "back")[0]["hparams"]["fc_norm"] is True
    assert torch.equal(draft_logits(str(tmp_path / "back"), tiny_target), draft_logits(normed, tiny_target))
    with pytest.raises(UserError, match="format=sglang: SGLang's EAGLE-3 has no norm on the target states"):
        run_export(checkpoint=normed, format="sglang", out=tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()


def test_import_specforge_layout_with_its_aux_layers(checkpoint, tiny_target, tmp_path):
    """A SpecForge/SGLang head that picked its own aux layers ("output of layer k" [0, 3, 6])."""
    run_export(checkpoint=checkpoint, format="sglang", out=tmp_path / "sglang")
    config, _ = files(tmp_path / "sglang")
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 3, 6]
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(config))
    run_export(checkpoint=tmp_path / "sglang", format="native", target="tiny_llama", out=tmp_path / "native")
    assert files(tmp_path / "native")[0]["hparams"]["aux_layers"] == [1, 4, 7]
    _, drafter = artifact.load(str(tmp_path / "native"), target=tiny_target)
    assert drafter.capture_layers() == [1, 4, 7]
    assert torch.equal(drafter.embed_tokens.weight, tiny_target.embed_weight)  # SGLang ships none: the target's


def test_import_eagle_repo_layout(checkpoint, tiny_target, tmp_path):
    """The EAGLE repo's layout: pytorch_model.bin, no aux ids in the config (engines default to
    [2, N//2, N-3] in our convention), no embedding."""
    run_export(checkpoint=checkpoint, format="sglang", out=tmp_path / "sglang")
    config, weights = files(tmp_path / "sglang")
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    del config["eagle_config"]
    (eagle / "config.json").write_text(json.dumps(config))
    torch.save(weights, eagle / "pytorch_model.bin")
    run_export(checkpoint=eagle, format="native", target="tiny_llama", out=tmp_path / "native")
    assert files(tmp_path / "native")[0]["hparams"]["aux_layers"] == [2, 4, 5]
    assert torch.equal(draft_logits(str(tmp_path / "native"), tiny_target), draft_logits(checkpoint, tiny_target))


def test_import_refuses_heads_that_compute_differently(checkpoint, tmp_path):
    run_export(checkpoint=checkpoint, format="speculators", out=tmp_path / "spec", verifier="org/tiny-llama")
    config, _ = files(tmp_path / "spec")
    for edit, message in [
        (lambda c: c.update(norm_before_residual=True), "norm_before_residual=true: our EAGLE-3 computes no such norm"),
        (lambda c: c["transformer_layer_config"].update(rope_theta=500000.0, rope_parameters=None), "rope_parameters"),
        (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), "2 draft layers; our EAGLE-3 has one"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 9]), "out of range for target tiny-llama"),
        (lambda c: c.update(speculators_model_type="mtp"), "config.json is no layout this version reads"),
    ]:
        edited = json.loads(json.dumps(config))
        edit(edited)
        (tmp_path / "spec" / "config.json").write_text(json.dumps(edited))
        with pytest.raises(UserError, match=message):
            run_export(checkpoint=tmp_path / "spec", format="native", target="tiny_llama", out=tmp_path / "native")
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "spec" / "model.safetensors")
    weights["layers.0.self_attn.q_norm.weight"] = weights.pop("lm_head.weight")[0]  # a Qwen3-style layer
    save_file(weights, tmp_path / "spec" / "model.safetensors")
    with pytest.raises(UserError, match="missing weights \\['lm_head.weight'\\]; unexpected weights "
                                        "\\['midlayer.self_attn.q_norm.weight'\\]"):
        run_export(checkpoint=tmp_path / "spec", format="native", target="tiny_llama", out=tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_bad_weights_are_named(checkpoint, tmp_path):
    cases = {
        "missing": (lambda w: w.pop("norm.weight"), "missing weights \\['norm.weight'\\]"),
        "extra": (lambda w: w.update({"midlayer.extra.weight": torch.zeros(2)}),
                  "unexpected weights \\['midlayer.extra.weight'\\]"),
        "shape": (lambda w: w.update({"fc.weight": torch.zeros(64, 128)}),
                  "wrong shapes \\['fc.weight \\[64, 128\\] \\(expected \\[64, 192\\]\\)'\\]"),
    }
    for name, (edit, message) in cases.items():
        broken = edited_copy(checkpoint, tmp_path / name, weights=edit)
        for fmt in ("native", "speculators", "sglang"):
            out = tmp_path / f"out-{name}-{fmt}"
            with pytest.raises(UserError, match=message):
                run_export(checkpoint=broken, format=fmt, out=out, verifier="org/tiny-llama")
            assert not out.exists()


def test_checkpoint_of_another_drafter(checkpoint, tmp_path):
    other = edited_copy(checkpoint, tmp_path / "nope", state=lambda s: s.update(drafter="nope"))
    for fmt in ("sglang", "native"):
        with pytest.raises(UserError, match="unknown drafter 'nope' \\(available: .*eagle3"):
            run_export(checkpoint=other, format=fmt, out=tmp_path / "out")
    with pytest.raises(UserError, match="format 'vllm' has no writer for drafter 'eagle3' \\(it has: eagle, medusa\\)"):
        run_export(checkpoint=checkpoint, format="vllm", out=tmp_path / "out")


def test_cli_error_is_one_line(checkpoint, tmp_path):
    """Through a real `python -m export.run` (the other export refusals run in-process in test_bad_input)."""
    result = cli(f"checkpoint={checkpoint}", "format=speculators", f"out={tmp_path / 'o'}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: format=speculators: vLLM loads the target from verifier.name_or_path")
    assert not (tmp_path / "o").exists()


def test_out_is_refused_or_replaced_whole(checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("old")  # a previous artifact, marked as export marks it
    (out / MARK_FILE).write_text(json.dumps({"kind": "drafter artifact"}))
    with pytest.raises(UserError, match="already exists"):
        run_export(checkpoint=checkpoint, out=out)
    bad = edited_copy(checkpoint, tmp_path / "bad", weights=lambda w: w.pop("d2t"))
    with pytest.raises(UserError, match="missing weights \\['d2t'\\]"):
        run_export(checkpoint=bad, out=out, overwrite="true")
    assert sorted(os.listdir(out)) == ["config.json", MARK_FILE]  # a failed export leaves the old out as it was
    assert (out / "config.json").read_text() == "old"
    run_export(checkpoint=checkpoint, out=out, overwrite="true")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", MARK_FILE]
    assert sorted(os.listdir(tmp_path)) == ["bad", "out"]  # no temp dirs left behind
    with pytest.raises(UserError, match="would overwrite"):
        run_export(checkpoint=out, out=out, overwrite="true")


def tree_digest(directory) -> dict:
    """Every path under `directory` (symlinks as their targets) with its bytes' hash."""
    import hashlib

    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if os.path.islink(path):
                found[relative] = "-> " + os.readlink(path)
            elif os.path.isfile(path):
                found[relative] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def test_no_destination_reaches_a_training_checkpoint(checkpoint, tmp_path):
    """out / verifier_out that are, contain or lie inside a checkpoint, through `latest` or not, are
    refused before anything is written, overwrite or not."""
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(checkpoint)), run, symlinks=True)
    latest, step = run / "checkpoints" / "latest", os.path.realpath(run / "checkpoints" / "latest")
    before = tree_digest(run)
    for source, destination in [(latest, step), (step, latest), (latest, run / "checkpoints"), (latest, run),
                                (step, os.path.join(step, "sub")),
                                (checkpoint, step)]:  # another run's checkpoint: never an out either
        with pytest.raises(UserError, match="would overwrite"):
            run_export(checkpoint=source, out=destination, overwrite="true")
    with pytest.raises(UserError, match="would overwrite"):
        run_export(checkpoint=step, format="speculators", out=tmp_path / "spec", verifier_out=step, overwrite="true")
    with pytest.raises(UserError, match="would overwrite"):
        run_export(checkpoint=step, format="speculators", out=tmp_path / "spec", verifier_out=tmp_path / "spec")
    assert tree_digest(run) == before
    assert not (tmp_path / "spec").exists()


def test_training_init_from_an_artifact(checkpoint, tmp_path):
    """drafter.init_from starts training from the artifact's weights (lr=0: they come out unchanged)."""
    run_export(checkpoint=checkpoint, format="sglang", out=tmp_path / "sglang")
    run_export(checkpoint=tmp_path / "sglang", format="native", target="tiny_llama", out=tmp_path / "native")
    result = subprocess.run(
        [sys.executable, "-m", "training.run", "target=tiny_llama", "logger=none", "data.max_samples=16",
         "data.eval_min=2", "data.max_length=64", "trainer.batch_size=2", "trainer.max_steps=1", "trainer.eval_max_samples=2",
         "trainer.lr=0", f"drafter.init_from={tmp_path / 'native'}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    start = load_file(os.path.join(tmp_path, "native", "model.safetensors"))
    trained = load_file(os.path.join(tmp_path, "run", "checkpoints", "latest", "model.safetensors"))
    assert start.keys() == trained.keys() and all(torch.equal(start[k], trained[k]) for k in start)


@pytest.mark.parametrize("drafter,hparams,steps", [
    ("eagle3", {"ttt_steps": 7, "aux_layers": [2, 4, 5]}, 7),  # the unroll it was trained for
    ("mtp", {"ttt_steps": 3}, 3),
    ("gemma_mtp", {"ttt_steps": 3, "num_heads": 8}, 3),  # num_heads: attention heads, not drafts
    ("dflash", {"block_size": 16, "num_layers": 5}, 15),  # a block's slots after the bonus token's
    ("dspark", {"block_size": 8, "markov_rank": 256}, 7),
    ("medusa", {"num_heads": 4, "num_layers": 1}, 4),  # one draft per head
    ("eagle", {"fc_bias": False, "feature_noise": 0.2}, 3),  # no trained length: what measured best
])
def test_default_steps_per_drafter(drafter, hparams, steps):
    assert default_proposal(drafter, hparams) == {"draft": "chain", "steps": steps}


@pytest.mark.parametrize("name", ["eagle3", "eagle", "medusa", "mtp", "gemma_mtp", "dflash", "dspark"])
def test_hparams_are_the_saved_settings_as_resolved(tiny_target, name):
    """What an artifact records is the drafter's Settings, declared once: every field but the
    training-only ones, defaults filled in as built (aux layers chosen, sizes taken from the target),
    in the field's type; a layer config beside them where the drafter has one."""
    drafter = random_drafter(name, tiny_target, vocab_over(tiny_target, list(range(5, 600))))
    hparams = drafter.hparams()
    saved = [spec.name for spec in settings.saved_fields(drafter.Settings)]
    assert list(hparams) == saved + ["layer_config"] * (drafter.layer_config is not None)
    assert not {"name", "init_from", "init_head_from_target", "num_aux", "native_mtp"} & hparams.keys()
    assert all(value is not None for key, value in hparams.items() if key != "native_layout")  # none: not read from one
    hints = typing.get_type_hints(drafter.Settings)
    for key in saved:
        kind = [option for option in typing.get_args(hints[key]) if option is not type(None)] or [hints[key]]
        assert hparams[key] is None or isinstance(hparams[key], typing.get_origin(kind[0]) or kind[0]), key
    rebuilt = drafter_class(name)(OmegaConf.create(hparams), tiny_target.spec, drafter.vocab)
    assert rebuilt.hparams() == hparams


def test_a_whole_number_for_a_float_setting_saves_as_a_float(tiny_target):
    vocab = vocab_over(tiny_target, list(range(5, 600)))
    cfg = compose_train(["target=tiny_llama", "drafter.loss_decay=1"]).drafter
    hparams = build_drafter(cfg, tiny_target, vocab).hparams()
    assert hparams["loss_decay"] == 1.0 and isinstance(hparams["loss_decay"], float)
    assert json.dumps(hparams["loss_decay"]) == "1.0"


def test_gguf_is_llamacpps_lean_eagle3_draft(checkpoint, tmp_path):
    """format=gguf through llama.cpp's own converter: its EAGLE-3 draft with our aux layers and draft
    vocabulary, q8_0 matrices, and no embedding of its own (llama.cpp then reads the target's)."""
    from drafters.storage.engines import llama_cpp_source
    from export.formats.gguf import HEAD_FILE

    try:
        source = llama_cpp_source()
    except UserError as missing:
        pytest.skip(str(missing))  # CI installs it (.ci/run)
    with pytest.raises(UserError, match="reads the target as an HF dir: pass verifier_out"):
        run_export(checkpoint=checkpoint, format="gguf", out=tmp_path / "refused")
    run_export(checkpoint=checkpoint, format="gguf", out=tmp_path / "head", verifier_out=tmp_path / "target")
    assert sorted(os.listdir(tmp_path / "head")) == [HEAD_FILE, "specdraft.json"]
    sys.path.insert(0, os.path.join(source, "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    head = GGUFReader(str(tmp_path / "head" / HEAD_FILE))
    field = head.fields["eagle3.target_layers"]
    saved = artifact.read(checkpoint)
    assert bytes(head.fields["general.architecture"].parts[-1]).decode() == "eagle3"
    assert [int(field.parts[index][0]) for index in field.data] == saved.hparams["aux_layers"]
    tensors = {tensor.name: tensor for tensor in head.tensors}
    assert "token_embd.weight" not in tensors
    assert tensors["fc.weight"].tensor_type.name == "Q8_0"
    d2t = saved.weights["d2t"]  # llama.cpp stores the target id of each draft token, we its offset
    assert torch.equal(torch.from_numpy(tensors["d2t"].data.copy()), torch.arange(len(d2t)) + d2t)
