"""serving.run / serving.bench / artifact loading on a tiny trained checkpoint, and losslessness
on the real SmolLM2-135M."""

import json
import os
import subprocess
import sys

import pytest

from conftest import CONF_DIR, PROMPTS, ROOT, chat_ids, compose_train, head_for, run_cli
from drafters.config.errors import UserError
from drafters.storage import artifact
from drafters.target.model import load_target
from serving.engine import generate_spec, generate_plain



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    result = subprocess.run(
        [sys.executable, "-m", "training.run", "target=tiny_llama", "logger=none", "data.max_samples=40",
         "data.max_length=128", "trainer.batch_size=2", "trainer.max_steps=2", "trainer.eval_max_samples=4",
         "drafter.ttt_steps=2", f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return str(run_dir / "checkpoints" / "latest")


def cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_artifact_round_trip_generates_losslessly(checkpoint, tiny_target):
    target, drafter = artifact.load(checkpoint, target=tiny_target)
    assert drafter.capture_layers() == [2, 4, 5]
    eos = {target.tokenizer.eos_token_id}
    ids = chat_ids(target, PROMPTS[0])
    assert generate_spec(target, drafter, ids, 24, eos)[0] == generate_plain(target, ids, 24, eos)[0]


def test_prompt_longer_than_training_length(checkpoint, tiny_target):
    """The checkpoint was trained on sequences of at most 128 tokens; serving must not care."""
    target, drafter = artifact.load(checkpoint, target=tiny_target)
    ids = chat_ids(target, " ".join(PROMPTS * 12))
    assert ids.shape[1] > 300
    eos = {target.tokenizer.eos_token_id}
    plain = generate_plain(target, ids, 16, eos)[0]
    for draft in ("chain", "tree"):
        assert generate_spec(target, drafter, ids, 16, eos, draft=draft, depth=3, topk=3, total=8)[0] == plain


def test_artifact_for_another_target_is_refused(checkpoint):
    other = load_target(compose_train(["target=tiny_llama", "target.random_init.hidden_size=32",
                                       "target.random_init.head_dim=8"]).target)
    with pytest.raises(UserError, match="hidden_size"):
        artifact.load(checkpoint, target=other)


def test_serving_run_cli(checkpoint):
    result = cli("serving.run", f"artifact={checkpoint}", "max_new_tokens=12", "dtype=float32", "prompt=Hello there")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "identical output: True" in result.stdout and "acceptance length" in result.stdout
    assert "draft=hybrid schedule=auto" in result.stdout  # the defaults: the head + n-gram drafts, scheduled


@pytest.mark.parametrize("overrides, schedule", [
    ([], "auto"), (["draft=chain"], "auto"), (["draft=ngram"], "auto"), (["draft=tree"], "fixed"),
    (["ngram.head=tree"], "fixed"), (["draft=chain", "min_confidence=0.5"], "fixed"),
    (["draft=tree", "schedule=fixed"], "fixed"), (["schedule=fixed"], "fixed"),
])
def test_schedule_null_is_auto_where_it_can_schedule(overrides, schedule):
    from hydra import compose, initialize_config_dir

    from serving.settings import check_options

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="serve", overrides=["artifact=x", *overrides])
    check_options(cfg)
    assert cfg.schedule == schedule


def test_serving_run_cli_sampling(checkpoint, tmp_path, capsys):
    result = run_cli("serving.run", [f"artifact={checkpoint}", "max_new_tokens=12", "dtype=float32", "prompt=Hello there",
                                     "temperature=0.8", "top_p=0.9", "steps=3", f"hydra.run.dir={tmp_path / 'chain'}"], capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "identical output: n/a (sampling)" in result.stdout
    tree = run_cli("serving.run", [f"artifact={checkpoint}", "max_new_tokens=12", "draft=tree", "depth=3", "topk=2",
                                   "temperature=0.8", f"hydra.run.dir={tmp_path / 'tree'}"], capsys)
    assert tree.returncode == 0, tree.stderr[-2000:]
    assert "identical output: n/a (sampling)" in tree.stdout and "draft=tree schedule=fixed" in tree.stdout


def test_bench_json_interface(checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]) + "\n")
    out = tmp_path / "res.json"
    result = cli("serving.bench", f"artifact={checkpoint}", f"prompts={prompts}", "n=2", "max_new_tokens=10",
                 "dtype=float32", "prompt_lookup_tokens=3", f"out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"artifact", "dtype", "draft", "steps", "temperature"} <= set(report["config"])
    entry = report["datasets"]["prompts.jsonl"]
    for key in ("accept_len", "accept_rate_by_pos", "tokens_per_s_spec", "tokens_per_s_plain", "speedup",
                "identical", "unexplained_divergences", "n_prompts"):
        assert key in entry
    assert entry["identical"] == 1.0 and entry["unexplained_divergences"] == 0 and entry["n_prompts"] == 2
    # no steps=: a chain of the unroll the head was trained for (drafter.ttt_steps=2), drafted at every
    # verification forward (the prefill forward drafts nothing)
    assert report["config"]["steps"] == 2 and len(entry["accept_rate_by_pos"]) == 2
    assert 1.0 <= entry["accept_len"] <= 1 + sum(entry["accept_rate_by_pos"])
    assert entry["drafted_forwards"] == 1.0  # a fixed chain drafts at every forward
    assert 1.0 <= entry["accept_len_prompt_lookup"] <= 4  # at most 3 looked-up tokens and the target's own
    lookup_rate = entry["tokens_per_s_prompt_lookup"]
    assert entry["speedup_over_prompt_lookup"] == pytest.approx(entry["tokens_per_s_spec"] / lookup_rate)
    assert (tmp_path / "res.png").exists()
    assert 0 < report["alpha_floor"] < 2 and entry["alpha_over_floor"] > 0
    # a draft step skips the extension's fc over the target's features: it reads less than a draft does
    assert 0 < report["alpha_step_floor"] < report["alpha_floor"] and entry["alpha_step_over_floor"] > 0
    # one lazy extension per verification forward (a fixed chain drafts at every one), the first over the prompt
    assert entry["extension"]["tokens_per_call"] > 1


def test_weights_read_counts_each_call_and_only_gathered_embedding_rows():
    import torch

    from serving.bench import weights_read

    torch.manual_seed(0)
    embed, linear = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 4)
    model = torch.nn.ModuleDict({"embed": embed, "linear": linear})
    tokens = torch.tensor([[3, 5, 7]])
    read = weights_read(model, lambda: [linear(embed(tokens)), linear(embed(tokens[:, :1]))])
    assert read == (3 + 1) * 8 * 4 + 2 * (8 * 4 + 4) * 4  # 4 rows of 8 floats; the linear twice, bias included


def test_bench_refuses_an_out_it_could_not_write_before_benchmarking(checkpoint, tmp_path):
    result = cli("serving.bench", f"artifact={checkpoint}", f"out={tmp_path / 'no' / 'such' / 'b.json'}", "n=1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (f"error: out {tmp_path / 'no' / 'such' / 'b.json'}: no directory "
                                                      f"{tmp_path / 'no' / 'such'} to write into")
    assert "prompts" not in result.stderr  # no benchmark ran


def test_missing_artifact_is_one_clear_line(tmp_path):
    """Through a real `python -m serving.bench` (serving.run's refusals run in-process in test_bad_input)."""
    result = cli("serving.bench", f"artifact={tmp_path / 'nope'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"error: artifact not found: {tmp_path / 'nope'}"


def test_corrupt_artifact_is_one_clear_error(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "trainer_state.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(open(os.path.join(checkpoint, "model.safetensors"), "rb").read())
    with pytest.raises(UserError, match="unreadable"):
        artifact.read(str(broken))
    (broken / "trainer_state.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="unreadable"):
        artifact.read(str(broken))
    (broken / "model.safetensors").write_bytes(open(os.path.join(checkpoint, "model.safetensors"), "rb").read())
    with pytest.raises(UserError, match=r"trainer_state.json lacks step, drafter, .*config$"):
        artifact.read(str(broken))


@pytest.mark.slow
def test_smollm2_chain_is_lossless_in_float32():
    target = load_target(compose_train(["target=llama", "target.dtype=float32"]).target)
    drafter = head_for(target, 4096)
    eos = {target.tokenizer.eos_token_id}
    for text in PROMPTS[:2]:
        ids = chat_ids(target, text)
        plain, _ = generate_plain(target, ids, 24, eos)
        spec, stats = generate_spec(target, drafter, ids, 24, eos, steps=5)
        assert spec == plain, text
        assert 1.0 <= stats.accept_len <= 6  # at most 5 drafts and the target's own token per forward


@pytest.mark.parametrize("engine,drafter,draft_vocab,refused", [
    ("vllm", "eagle3", 512, None), ("vllm", "medusa", 49152, None), ("vllm", "dflash", 512, None),
    ("vllm", "medusa", 512, "engine=vllm: vLLM serves Medusa heads over the target's whole vocabulary \\(49152"),
    ("vllm", "eagle", 512, "engine=vllm: vLLM serves EAGLE-1 heads over the target's whole vocabulary \\(49152"),
    ("vllm", "dspark", 512, "serves eagle3, eagle, medusa, dflash heads from this project, not dspark"),
    ("llamacpp", "eagle3", 512, None), ("llamacpp", "medusa", 49152, "serves eagle3 heads from this project, not medusa"),
])
def test_an_engine_refuses_a_head_it_cannot_serve_up_front(engine, drafter, draft_vocab, refused):
    from serving.engines import check_head

    head = artifact.SavedDrafter(drafter, {"draft_vocab_size": draft_vocab}, {"vocab_size": 49152}, {}, {}, {})
    if refused is None:
        check_head(engine, head)
    else:
        with pytest.raises(UserError, match=refused):
            check_head(engine, head)
