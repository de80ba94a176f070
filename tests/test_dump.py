"""The offline hidden-state cache (`python -m training.dump`, `data.hidden_states=offline|cached`) on the
tiny random target: it reproduces the online teacher, resumes after a kill without rewriting
finished shards, dumps data-parallel, and refuses a cache made for another run."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from accelerate import PartialState
from safetensors.torch import load_file

from conftest import ROOT, TINY_RUN, compose_train, one_line_error, records, run_cli
from drafters.config.errors import UserError
from drafters.target.model import load_target
from training import data, hidden_cache
from training.dump import dump
from training.trainer import build_model, make_batch, make_teacher, prepare_data

SETTINGS = [*TINY_RUN, "data.cache.shard_sequences=4", "logger=none"]
ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def settings(cache_dir, *more):
    return [*SETTINGS, f"data.cache.dir={cache_dir}", *more]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """A bf16 and an fp8 cache of the tiny target, dumped in this process."""
    made = {}
    for dtype in ("bf16", "fp8"):
        directory = tmp_path_factory.mktemp(f"cache-{dtype}")
        cfg = compose_train(settings(directory, f"data.cache.dtype={dtype}"))
        made[dtype] = (cfg, dump(cfg))
    return made


@pytest.mark.parametrize("dtype, tolerance", [("bf16", 2**-8), ("fp8", 2**-4)])
def test_offline_teacher_and_loss_match_online(caches, tmp_path, dtype, tolerance):
    cfg, result = caches[dtype]
    assert result["written"] == 11 and result["skipped"] == 0  # 26 train + 16 eval sequences, 4 per shard
    stats = result["cache"]
    # 3 aux vectors per token, the final one only at teacher positions: under speculators' 4 bf16 vectors
    assert stats["ratio_to_speculators"] < (0.95 if dtype == "bf16" else 0.5), stats

    target = load_target(cfg.target)
    train_set, eval_set = prepare_data(cfg, target)
    drafter, vocab, _ = build_model(cfg, target, train_set, str(tmp_path))
    layers = drafter.capture_layers()
    online = make_teacher(cfg, target, vocab, layers, train_set, eval_set)
    offline = make_teacher(OmegaConf.merge(cfg, {"data": {"hidden_states": "offline"}}), target, vocab, layers,
                           train_set, eval_set)
    indices = [5, 0, 13, 21]  # across shards, in an order of their own
    batch = make_batch(train_set, indices, target.tokenizer.pad_token_id or 0, "cpu")
    live, stored = online("train", indices, batch), offline("train", indices, batch)

    real = batch["attention_mask"].bool()
    for live_aux, stored_aux in zip(live.aux, stored.aux):
        scale = live_aux.abs().amax(-1, keepdim=True)  # fp8 error is relative to each vector's max
        assert ((stored_aux - live_aux).abs() <= tolerance * scale)[real].all()
        assert (stored_aux[~real] == 0).all()
    taught = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1)).bool()  # teacher positions
    error = (stored.final - live.final).abs()
    assert (error <= tolerance * live.final.abs().amax(-1, keepdim=True))[taught].all()
    # the greedy tokens are stored, not recomputed from the rounded final state: they agree exactly
    assert torch.equal(live.teacher_token[taught], stored.teacher_token[taught])
    assert torch.equal(live.in_vocab[taught], stored.in_vocab[taught])
    assert live.in_vocab[taught].any() and not live.in_vocab[taught].all()  # both cases are in the batch
    assert not stored.in_vocab[~taught].any() and not stored.teacher_logits[~taught].any()  # read nowhere else
    with torch.no_grad():
        loss_live, _ = drafter(batch, live)
        loss_stored, _ = drafter(batch, stored)
    assert abs(loss_stored.item() - loss_live.item()) <= 2 * tolerance * loss_live.item(), (loss_live, loss_stored)


def test_a_stale_or_missing_cache_is_refused(caches, tmp_path):
    cfg, _ = caches["bf16"]
    target = load_target(cfg.target)
    train_set, eval_set = prepare_data(cfg, target)
    layers = [2, 4, 5]
    hidden_cache.HiddenCache.open(cfg, target, layers, train_set, eval_set)  # the matching run is accepted

    with pytest.raises(UserError, match="stale: it holds layers"):
        hidden_cache.HiddenCache.open(cfg, target, [1, 2, 3], train_set, eval_set)
    other_data = compose_train(settings(cfg.data.cache.dir, "data.max_samples=50"))
    with pytest.raises(UserError, match="stale: it holds data"):
        hidden_cache.HiddenCache.open(other_data, target, layers, *prepare_data(other_data, target))
    other_target = load_target(compose_train(["target=tiny_llama", "target.random_init.seed=7"]).target)
    with pytest.raises(UserError, match="stale: it holds target_fingerprint"):
        hidden_cache.HiddenCache.open(cfg, other_target, layers, train_set, eval_set)
    with pytest.raises(UserError, match="no hidden-state cache"):
        hidden_cache.HiddenCache.open(compose_train(settings(tmp_path / "none")), target, layers, train_set, eval_set)


def test_offline_training_and_its_one_line_refusal(caches, tmp_path, capsys):
    cfg, _ = caches["bf16"]
    run = [sys.executable, "-m", "training.run", *settings(cfg.data.cache.dir, "data.hidden_states=offline",
                                                           "trainer.max_steps=2", "trainer.log_every=1")]
    result = subprocess.run([*run, f"hydra.run.dir={tmp_path / 'ok'}"], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hidden states: offline" in result.stdout + result.stderr
    assert [r["step"] for r in records(tmp_path / "ok") if "train/loss" in r] == [1, 2]

    refused = run_cli("training.run", [*run[3:], "drafter.aux_layers=[1,2,3]", f"hydra.run.dir={tmp_path / 'stale'}"],
                      capsys)
    one_line_error(refused, "is stale", "layers=[2, 4, 5]", "layers=[1, 2, 3]")


def test_a_cached_run_writes_the_cache_once_then_trains_as_offline(caches, tmp_path):
    """data.hidden_states=cached: the first run dumps (the same shards as training.dump) and trains,
    a second one only reads, and both train the weights an offline run trains from the dump."""
    reference = Path(caches["bf16"][0].data.cache.dir)
    directory = tmp_path / "cache"
    steps = ["trainer.max_steps=2", "trainer.eval_every=100"]

    def train(run, mode, cache):
        result = subprocess.run([sys.executable, "-m", "training.run", *settings(cache, f"data.hidden_states={mode}", *steps),
                                 f"hydra.run.dir={tmp_path / run}"], cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"},
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr, load_file(tmp_path / run / "checkpoints" / "step-2" / "model.safetensors")

    log, first = train("first", "cached", directory)
    # the dump ran in a child process (its heap freed before training), logging through the run's handlers
    assert "writing the cache in a child process" in log
    assert "wrote 11 shards (42 sequences run through the target, 0 copied" in log and "skipped 0 complete" in log
    assert hidden_cache.read_index(str(directory))["complete"]
    assert "wrote 11 shards" in (tmp_path / "first" / "run.log").read_text()
    assert_same_shards(directory, reference)
    written = shard_state(directory)
    log, second = train("second", "cached", directory)
    assert "in a child process" not in log
    assert "wrote 0 shards (0 sequences run through the target, 0 copied" in log and "skipped 11 complete" in log
    assert shard_state(directory) == written
    _, offline = train("offline", "offline", reference)
    assert all(first[name].equal(offline[name]) and second[name].equal(offline[name]) for name in offline)


def test_a_mistake_found_in_the_dump_child_is_one_line(tmp_path, capsys):
    """A cached run's child process finds the malformed line: the parent reports it as its own."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n{oops\n')
    result = run_cli("training.run", [*settings(tmp_path / "cache", "data.hidden_states=cached", f"data.path={data}"),
                                      f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    one_line_error(result, "bad.jsonl:2: malformed JSON")
    assert not (tmp_path / "run" / "checkpoints").exists()


def shard_state(directory):
    return {name: (os.stat(directory / name).st_ino, os.stat(directory / name).st_mtime_ns)
            for name in os.listdir(directory) if name.endswith(".safetensors")}


def assert_same_shards(directory, reference):
    names = sorted(name for name in os.listdir(reference) if name.endswith(".safetensors"))
    assert names == sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    for name in names:
        mine, theirs = load_file(directory / name), load_file(reference / name)
        assert mine.keys() == theirs.keys()
        for key in theirs:
            assert mine[key].view(torch.uint8).equal(theirs[key].view(torch.uint8)), (name, key)


def test_killed_dump_resumes_without_rewriting_finished_shards(caches, tmp_path):
    cfg, _ = caches["bf16"]
    directory = tmp_path / "cache"
    overrides = settings(directory, f"hydra.run.dir={tmp_path / 'run'}")
    process = subprocess.Popen([sys.executable, "-m", "training.dump", *overrides], cwd=ROOT, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    written = 0
    for line in process.stdout:
        written += "dump: wrote" in line
        if written == 2:
            process.send_signal(signal.SIGKILL)
            break
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the dump finished before it could be killed"
    assert not hidden_cache.read_index(str(directory))["complete"]
    finished = shard_state(directory)
    assert 2 <= len(finished) < 11
    # as a kill mid-write leaves (drafters/storage/writes.py names temp files by their writer's pid)
    (directory / f".train-00006.safetensors.partial-{process.pid}-0123abcd").write_bytes(b"half a shard")

    result = dump(compose_train(overrides))
    assert result["skipped"] == len(finished) and result["written"] == 11 - len(finished)
    assert {name: shard_state(directory)[name] for name in finished} == finished, "a finished shard was rewritten"
    assert not [name for name in os.listdir(directory) if ".partial-" in name]
    assert hidden_cache.read_index(str(directory))["complete"]
    assert_same_shards(directory, Path(cfg.data.cache.dir))


@pytest.mark.long
def test_two_process_dump_writes_the_same_cache(caches, tmp_path):
    cfg, _ = caches["bf16"]
    directory = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-m", "training.launch", *settings(directory), "launch.module=training.dump",
         "launch.processes_per_node=2", "launch.main_port=29517", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    # each process wrote its own shards: 0, 2, 4, ... and 1, 3, 5, ... of each split
    assert "dump process 0: wrote 6 shards" in output and "dump process 1: wrote 5 shards" in output
    assert hidden_cache.read_index(str(directory))["complete"]
    assert_same_shards(directory, Path(cfg.data.cache.dir))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoding_keeps_the_states_a_dump_computes(varied_target, temperature):
    """Regeneration's states of each training sequence (prompt + answer + closing tokens fed after
    the answer) are those the target computes over the whole sequence at once, for answers that end
    on an end token and answers cut at max_new_tokens alike; the teacher's token is the greedy one
    even where the answers are sampled."""
    target, closing, limit = varied_target, [7, 8], 8
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 6, 12)]
    ids, mask = data._left_pad(prompts, 0)
    capture = hidden_cache.RegenCapture(target, [1, 3], max_length=64)
    with torch.inference_mode():
        free, _ = data._decode(target.model, ids, mask, limit, set(), 0.0)
        ends = {free[0][3], free[2][1]}
        torch.manual_seed(0)
        rows, states = data._decode(target.model, ids, mask, limit, ends, temperature, capture, closing)
    assert any(len(row) == limit for row in rows) and (temperature or (len(rows[0]) <= 3 and len(rows[2]) <= 1))
    for prompt, row, kept in zip(prompts, rows, states):
        sequence = torch.tensor([prompt + row + closing])
        aux, final = target.capture(sequence, None, capture.layers)
        teacher = slice(len(prompt) - 1, len(prompt) + len(row))  # the prompt's last token to the answer's last
        torch.testing.assert_close(kept["aux"], torch.stack(aux, 2)[0], rtol=1e-3, atol=1e-3)  # a cache, not one pass
        torch.testing.assert_close(kept["final"], final[0, teacher], rtol=1e-3, atol=1e-3)
        greedy = target.argmax(final[0, teacher])
        assert kept["greedy"].tolist() == greedy.tolist()
        if not temperature:
            assert greedy.tolist() == row + greedy[-1:].tolist() and (greedy[-1].item() in ends) == (len(row) < limit)
    if temperature:  # sampled answers: not the greedy ones
        assert any(kept["greedy"][:-1].tolist() != row for row, kept in zip(rows, states))


def test_a_regenerating_dump_reads_the_states_regeneration_kept(tmp_path):
    """A cached run that regenerates its answers runs the target over none of them again: its shards
    hold what the target computes over the rendered sequences (the same greedy tokens)."""
    regenerating = ["data.regenerate=true", "data.regen.max_new_tokens=12", "data.max_samples=24",
                    f"cache_dir={tmp_path / 'caches'}"]
    cfg = compose_train(settings(tmp_path / "cache", *regenerating))
    result = dump(cfg)
    target = load_target(cfg.target)
    train_set, eval_set = prepare_data(cfg, target)  # the regenerated answers, from their cache
    assert result["reused"] == len(train_set) + len(eval_set) > 16
    reference = compose_train(settings(tmp_path / "reference", *regenerating))
    layers = hidden_cache.read_index(str(cfg.data.cache.dir))["layers"]
    assert hidden_cache.write(reference, target, layers, train_set, eval_set, PartialState(cpu=True))["reused"] == 0
    names = sorted(name for name in os.listdir(tmp_path / "reference") if name.endswith(".safetensors"))
    assert names == sorted(name for name in os.listdir(tmp_path / "cache") if name.endswith(".safetensors"))
    for name in names:
        mine, computed = load_file(tmp_path / "cache" / name), load_file(tmp_path / "reference" / name)
        for key in ("greedy", "aux_offsets", "final_offsets"):
            assert torch.equal(mine[key], computed[key]), (name, key)
        for key in ("aux", "final"):
            torch.testing.assert_close(mine[key].float(), computed[key].float(), rtol=2**-7, atol=2**-7)


def test_an_unreadable_kept_state_file_is_one_line(tmp_path, varied_target):
    capture = hidden_cache.RegenCapture(varied_target, [1], max_length=64)
    capture.directory = tmp_path
    (tmp_path / "batch-0123.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="batch-0123.safetensors are unreadable .*delete the file"):
        capture.states([1, 2, 3], [0, 1, 1])
