"""The error contract (docs/errors.md), one bad input at a time, across every
entry point: exit code 2, exactly one `error:` line naming the culprit, no traceback, and every
file that existed before (a trained run, its checkpoints, an artifact) byte-identical afterwards.

The commands run in this process, through their real `hydra.main` (the same code path as
`python -m ...`, without an interpreter start per case); a few cases in test_serving.py and
test_export.py run them as subprocesses. Then: an export SIGKILLed while writing its artifact leaves
the previous one loadable (a training run killed while saving: test_training.py).
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, kill_while_writing, run_cli
from drafters.storage.artifact import read

TINY = ["target=tiny_llama", "logger=none", "data.max_samples=40", "data.max_length=128", "trainer.batch_size=2",
        "trainer.eval_max_samples=4", "trainer.max_minutes=null"]
# Hydra appends every invocation of a run dir to its run.log, or launch.log for training.launch (.hydra/
# is written only by a run that starts)
HYDRA_RECORDS = ("run.log", "launch.log")


def train_cli(run_dir, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "training.run", *TINY, f"hydra.run.dir={run_dir}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained run (checkpoints at steps 2 and 4), a native artifact, and user files."""
    root = tmp_path_factory.mktemp("world")
    run = root / "run"
    result = train_cli(run, "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2")
    assert result.returncode == 0, result.stderr[-2000:]
    for out, *args in (("artifact",), ("speculators", "format=speculators", "verifier=tiny-llama")):
        result = subprocess.run([sys.executable, "-m", "export.run", f"checkpoint={run / 'checkpoints' / 'latest'}",
                                 f"out={root / out}", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    files = root / "files"
    files.mkdir()
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    (files / "empty.jsonl").write_text("")
    (files / "no_answer.jsonl").write_text("\n".join(json.dumps({"messages": chat[:1]}) for _ in range(5)))
    (files / "types.jsonl").write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": 5},
                                                                          {"role": "assistant", "content": ["x"]}]})
                                                 for _ in range(5)))
    (files / "one.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (files / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"Question {i}?"}) for i in range(5)))
    (files / "bad_line.jsonl").write_text(json.dumps({"messages": chat}) + "\n{not json\n")
    records = json.dumps([{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
                          for i in range(22)], indent=0).splitlines()
    records[12] = records[12].rstrip(",")  # a missing comma in the third record...
    (files / "broken.json").write_text("\n".join(records[:-1]))  # ...and no closing ]
    (files / "not_a_prompt.jsonl").write_text("[1, 2]\n")
    (files / "binary.json").write_bytes(bytes(range(128, 256)))
    (files / "not_a_model").mkdir()
    (files / "not_a_model" / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 8}))
    broken = root / "broken_checkpoint"
    shutil.copytree(run / "checkpoints" / "step-4", broken)
    (broken / "trainer_state.json").write_text('{"step": 4, "drafter"')
    for name in ("model.safetensors", "optimizer.bin"):  # a checkpoint with one file cut short
        cut = root / f"cut_{name.split('.')[0]}"
        shutil.copytree(run / "checkpoints" / "step-4", cut)
        (cut / name).write_bytes((cut / name).read_bytes()[:200])
    model = root / "model_dir"  # a target model as save_pretrained writes it: weights, config, tokenizer
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(root / "artifact" / name if name != "tokenizer.json" else files / "one.jsonl", model / name)
    garbage = root / "garbage_weights"
    shutil.copytree(root / "artifact", garbage)
    (garbage / "model.safetensors").write_bytes(b"\x00" * 100)
    malformed_artifacts(root)
    hidden_state_caches(root)
    (files / "project").mkdir()  # a user's folder that happens to hold a config.json
    (files / "project" / "config.json").write_text("{}")
    (files / "project" / "notes.txt").write_text("mine")
    shutil.copytree(model, files / "model_no_tokenizer", ignore=shutil.ignore_patterns("tokenizer.json"))
    (files / "exp.yaml").write_text("mine: true\n")  # what a benchmark's out=exp.json would write beside it
    (files / "notes.json").write_text('{"mine": true}')
    return root


def malformed_artifacts(root):
    """Copies of the native artifact, each with one thing wrong in its config or weights."""
    def edit(name, config=None, weights=None):
        path = root / "bad" / name
        shutil.copytree(root / "artifact", path)
        if config:
            document = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps(config(document)))
        if weights:
            tensors = load_file(path / "model.safetensors")
            weights(tensors)
            save_file(tensors, path / "model.safetensors")

    edit("config_list", lambda c: [c])
    edit("hparams_list", lambda c: {**c, "hparams": [1]})
    edit("no_verifier", lambda c: {k: v for k, v in c.items() if k != "verifier"})
    edit("vocab_size_text", lambda c: {**c, "verifier": {**c["verifier"], "vocab_size": "big"}})
    edit("drafter_number", lambda c: {**c, "drafter": 5})
    edit("drafter_unknown", lambda c: {**c, "drafter": "eagle9"})
    edit("hparams_without_vocab", lambda c: {**c, "hparams": {k: v for k, v in c["hparams"].items() if k != "draft_vocab_size"}})
    edit("steps_text", lambda c: {**c, "proposal": {**c["proposal"], "steps": "x"}})
    edit("d2t_out_of_range", weights=lambda w: w.update(d2t=w["d2t"] + 100000))
    edit("d2t_float", weights=lambda w: w.update(d2t=w["d2t"].float()))
    edit("t2d_int", weights=lambda w: w.update(t2d=w["t2d"].long()))
    edit("nan_weights", weights=poison)


def poison(weights: dict) -> None:
    """One float weight NaN: what a diverged run would have saved."""
    name = next(name for name in sorted(weights) if weights[name].is_floating_point())
    weights[name] = torch.full_like(weights[name], float("nan"))


def hidden_state_caches(root):
    """A dump of the tiny target's data, and copies of it with one fault each."""
    for name, extra in (("cache", []), ("cache_other_target", ["target.random_init.seed=7"])):
        result = subprocess.run([sys.executable, "-m", "training.dump", *TINY, *extra, f"data.cache.dir={root / name}",
                                 f"hydra.run.dir={root / 'dumps' / name}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    faults = {
        "cut_shard": lambda c: (c / "train-00000.safetensors").write_bytes((c / "train-00000.safetensors").read_bytes()[:5000]),
        "foreign_shard": lambda c: shutil.copy(root / "cache_other_target" / "train-00000.safetensors", c),
        "missing_shard": lambda c: os.remove(c / "eval-00000.safetensors"),
        "index_list": lambda c: (c / "index.json").write_text("[1, 2]"),
        "index_cut": lambda c: (c / "index.json").write_text((c / "index.json").read_text()[:90]),
        "other_shard_size": lambda c: (c / "index.json").write_text(json.dumps({**json.loads((c / "index.json").read_text()),
                                                                               "shard_sequences": 7})),
    }
    for name, fault in faults.items():
        shutil.copytree(root / "cache", root / "caches" / name)
        fault(root / "caches" / name)


def snapshot(root) -> dict[str, str]:
    """Every file under `root` (links as their targets' names) -> its sha256, Hydra's records aside."""
    found = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in HYDRA_RECORDS]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            path = os.path.join(directory, name)
            if name in HYDRA_RECORDS:
                continue
            relative = os.path.relpath(path, root)
            if os.path.islink(path):
                found[relative] = "-> " + os.readlink(path)
            else:
                with open(path, "rb") as handle:
                    found[relative] = hashlib.sha256(handle.read()).hexdigest()
    return found


# (id, module, arguments with {root}/{run}/{tmp} placeholders, what the error line must say)
CASES = [
    # training: numeric settings, enums, cross-key checks
    ("max_steps_zero", "training.run", ["trainer.max_steps=0"], "trainer.max_steps=0: must be >= 1"),
    ("max_steps_negative", "training.run", ["trainer.max_steps=-3"], "trainer.max_steps=-3: must be >= 1"),
    ("batch_size_zero", "training.run", ["trainer.batch_size=0"], "trainer.batch_size=0: must be >= 1"),
    ("grad_accum_zero", "training.run", ["trainer.grad_accum=0"], "trainer.grad_accum=0: must be >= 1"),
    ("eval_every_zero", "training.run", ["trainer.eval_every=0"], "trainer.eval_every=0: must be >= 1"),
    ("save_every_negative", "training.run", ["trainer.save_every=-1"], "trainer.save_every=-1: must be >= 1"),
    ("lr_negative", "training.run", ["trainer.lr=-1"], "trainer.lr=-1: must be >= 0"),
    ("lr_not_a_number", "training.run", ["trainer.lr=fast"], "trainer.lr=fast: must be a finite number >= 0"),
    ("schedule_unknown", "training.run", ["trainer.schedule=foo"], "trainer.schedule=foo: must be one of cosine | constant"),
    ("precision_unknown", "training.run", ["trainer.precision=fp8"], "trainer.precision=fp8: must be one of auto"),
    ("max_minutes_zero", "training.run", ["trainer.max_minutes=0"], "trainer.max_minutes=0: must be > 0"),
    ("deadline_not_a_number", "training.run", ["trainer.deadline_minutes=abc"], "trainer.deadline_minutes=abc: must be a finite number > 0"),
    ("regen_minutes_not_a_number", "training.run", ["data.regen.max_minutes=soon"], "data.regen.max_minutes=soon: must be a finite number > 0 or auto"),
    ("min_lr_ratio_above_one", "training.run", ["trainer.min_lr_ratio=2"], "trainer.min_lr_ratio=2: must be <= 1"),
    ("grad_clip_zero", "training.run", ["trainer.grad_clip=0"], "trainer.grad_clip=0: must be > 0"),
    ("max_length_zero", "training.run", ["data.max_length=0"], "data.max_length=0: must be >= 2"),
    ("eval_fraction_two", "training.run", ["data.eval_fraction=2"], "data.eval_fraction=2: must be <= 1"),
    ("hidden_states_unknown", "training.run", ["data.hidden_states=sometimes"], "data.hidden_states=sometimes: must be one of online | offline"),
    ("cache_dtype_unknown", "training.run", ["data.cache.dtype=int4"], "data.cache.dtype=int4: must be one of bf16 | fp8"),
    ("regen_batch_zero", "training.run", ["data.regen.batch_size=0"], "data.regen.batch_size=0: must be >= 1"),
    ("max_samples_zero", "training.run", ["data.max_samples=0"], "data.max_samples=0: must be >= 1"),
    ("ttt_steps_zero", "training.run", ["drafter.ttt_steps=0"], "drafter.ttt_steps=0: must be >= 1"),
    ("aux_layers_empty", "training.run", ["drafter.aux_layers=[]"], "drafter.aux_layers=[]: must be a non-empty list"),
    ("aux_layers_negative", "training.run", ["drafter.aux_layers=[1,-2]"], "drafter.aux_layers[1]=-2: must be >= 0"),
    ("dflash_block_of_one", "training.run", ["drafter=dflash", "drafter.block_size=1"], "drafter.block_size=1: must be >= 2"),
    ("medusa_no_heads", "training.run", ["drafter=medusa", "drafter.num_heads=0"], "drafter.num_heads=0: must be >= 1"),
    ("flag_not_boolean", "training.run", ["drafter.init_head_from_target=3"], "drafter.init_head_from_target=3: must be true or false"),
    ("target_dtype_unknown", "training.run", ["target.dtype=half"], "target.dtype=half: must be one of auto"),
    ("target_path_and_package", "training.run", ["+target.path=/models/mine"], "target.path=/models/mine: this target preset loads"),
    ("target_random_init_negative", "training.run", ["target.random_init.hidden_size=-4"], "target.random_init does not build a llama model"),
    ("logger_mode_unknown", "training.run", ["logger=wandb", "logger.mode=sometimes"], "logger.mode=sometimes: must be one of"),
    ("aux_layers_repeated", "training.run", ["drafter.aux_layers=[1,1,2]"], "drafter.aux_layers=[1, 1, 2]: names a value twice"),
    ("dflash_aux_layers_repeated", "training.run", ["drafter=dflash", "drafter.aux_layers=[0,2,2]"], "drafter.aux_layers=[0, 2, 2]: names a value twice"),
    ("cache_dir_empty", "training.run", ["cache_dir="], "cache_dir=: must not be empty"),
    ("aux_layer_beyond_target", "training.run", ["drafter.aux_layers=[1,2,99]"], "99"),
    ("unknown_trainer_key", "training.run", ["+trainer.lerning_rate=1e-4"], "trainer.lerning_rate: no such setting (the settings here: max_steps"),
    ("unknown_drafter_key", "training.run", ["+drafter.layers=2"], "drafter.layers: no such setting"),
    # training: runs and checkpoints
    ("resume_not_a_checkpoint", "training.run", ["trainer.resume={tmp}"], "is not a training checkpoint"),
    ("resume_no_over_checkpoints", "training.run", ["hydra.run.dir={run}", "trainer.max_steps=8"], "already holds checkpoints (step-2, step-4)"),
    ("run_dir_inside_a_checkpoint", "training.run", ["hydra.run.dir={run}/checkpoints/latest"], "hydra.run.dir {run}/checkpoints/latest would overwrite the training checkpoint"),
    ("run_dir_is_checkpoints_dir", "training.run", ["hydra.run.dir={run}/checkpoints"], "is another run's checkpoints/ dir"),
    ("resume_past_max_steps", "training.run", ["hydra.run.dir={run}", "trainer.resume=auto", "trainer.max_steps=4"], "already at step 4 and trainer.max_steps=4"),
    ("resume_corrupt_state", "training.run", ["trainer.resume={root}/broken_checkpoint", "trainer.max_steps=8"], "broken_checkpoint/trainer_state.json is unreadable"),
    ("resume_cut_weights", "training.run", ["trainer.resume={root}/cut_model", "trainer.max_steps=8"], "cannot resume from"),
    ("resume_cut_optimizer", "training.run", ["trainer.resume={root}/cut_optimizer", "trainer.max_steps=8"], "cut_optimizer: its saved state is unreadable"),
    ("max_length_past_positions", "training.run", ["data.max_length=4096"], "data.max_length=4096: must be <= the 2048 positions"),
    ("resume_other_target", "training.run", ["trainer.resume={run}/checkpoints/latest", "trainer.max_steps=8", "target.random_init.seed=7"],
     "cannot resume from {run}/checkpoints/latest: it was trained with target_fingerprint="),
    ("resume_other_vocabulary", "training.run", ["hydra.run.dir={run}", "trainer.resume=auto", "trainer.max_steps=8", "data.max_samples=30"], "draft vocabulary was built from other inputs; changed: the training conversations"),
    # training: data files
    ("eval_accept_tokens_past_positions", "training.run", ["trainer.eval_accept_prompts=1", "trainer.eval_accept_tokens=100000"],
     "trainer.eval_accept_tokens=100000: must be <= the 2048 positions"),
    ("target_not_a_causal_lm", "training.run", ["target=hf", "target.path={root}/files/not_a_model"], "not a causal LM"),
    ("data_missing", "training.run", ["data.path={tmp}/none.jsonl"], "data file not found"),
    ("data_empty", "training.run", ["data.path={root}/files/empty.jsonl"], "the file holds no records"),
    ("data_no_answers", "training.run", ["data.path={root}/files/no_answer.jsonl"], "5 records without an assistant answer"),
    ("data_wrong_types", "training.run", ["data.path={root}/files/types.jsonl"], "5 records whose turns are not role/text pairs"),
    ("data_prompts_only", "training.run", ["data.path={root}/files/prompts.jsonl"], "pass data.regenerate=true"),
    ("data_malformed_line", "training.run", ["data.path={root}/files/bad_line.jsonl"], "bad_line.jsonl:2: malformed JSON"),
    ("data_a_directory", "training.run", ["data.path={root}/files"], "data file is a directory"),
    ("data_one_conversation", "training.run", ["data.path={root}/files/one.jsonl"], "1 usable conversation(s)"),
    ("data_broken_unclosed_array", "training.run", ["data.path={root}/files/broken.json"], "broken.json:14: malformed JSON"),
    ("data_binary", "training.run", ["data.path={root}/files/binary.json"], "binary.json is not UTF-8 text"),
    ("zero2_in_one_cpu_process", "training.run", ["distributed=zero2"], "distributed=zero2 on CPU needs 2 or more processes"),
    ("gemma_width_not_divisible", "training.run", ["drafter=gemma_mtp", "drafter.hidden_size=30"], "drafter.hidden_size=30: must be a multiple of its 4 attention heads"),
    ("dflash_more_aux_than_layers", "training.run", ["drafter=dflash", "drafter.num_aux=100"], "drafter.num_aux=100: more aux layers than the 5"),
    # launch and dump
    ("launch_zero_processes", "training.launch", ["launch.processes_per_node=0", "launch.dry_run=true"], "launch.processes_per_node=0: must be >= 1"),
    ("launch_negative_nodes", "training.launch", ["launch.nodes=-1", "launch.dry_run=true"], "launch.nodes=-1: must be >= 1"),
    ("launch_rank_past_nodes", "training.launch", ["launch.node_rank=2", "launch.dry_run=true"], "launch.node_rank=2: must be below launch.nodes=1"),
    ("launch_unknown_module", "training.launch", ["launch.module=training.eval", "launch.dry_run=true"], "launch.module=training.eval: must be one of"),
    ("dump_into_an_artifact", "training.dump", ["data.cache.dir={root}/artifact"], "holds other files (config.json"),
    ("dump_into_a_checkpoint", "training.dump", ["data.cache.dir={run}/checkpoints/latest/cache"], "would overwrite the training checkpoint"),
    # serving
    ("serve_no_artifact", "serving.run", [], "artifact is required: pass artifact=..."),
    ("serve_steps_zero", "serving.run", ["artifact={root}/artifact", "steps=0"], "steps=0: must be >= 1"),
    ("serve_draft_unknown", "serving.run", ["artifact={root}/artifact", "draft=bush"], "draft=bush: must be one of chain | tree"),
    ("serve_topk_zero", "serving.run", ["artifact={root}/artifact", "draft=tree", "topk=0"], "topk=0: must be >= 1"),
    ("serve_temperature_negative", "serving.run", ["artifact={root}/artifact", "temperature=-1"], "temperature=-1: must be >= 0"),
    ("serve_top_p_above_one", "serving.run", ["artifact={root}/artifact", "top_p=1.5"], "top_p=1.5: must be <= 1"),
    ("serve_no_new_tokens", "serving.run", ["artifact={root}/artifact", "max_new_tokens=0"], "max_new_tokens=0: must be >= 1"),
    ("serve_dtype_unknown", "serving.run", ["artifact={root}/artifact", "dtype=int8"], "dtype=int8: must be one of"),
    ("serve_past_positions", "serving.run", ["artifact={root}/artifact", "max_new_tokens=5000"], "exceed the 2048 positions of target tiny-llama"),
    ("serve_garbage_weights", "serving.run", ["artifact={root}/garbage_weights"], "garbage_weights is unreadable"),
    ("serve_artifact_missing", "serving.run", ["artifact={tmp}/nope"], "artifact not found"),
    ("bench_n_zero", "serving.bench", ["artifact={root}/artifact", "n=0", "out={tmp}/b.json"], "n=0: must be >= 1"),
    ("bench_no_prompt_sets", "serving.bench", ["artifact={root}/artifact", "prompts=[]", "out={tmp}/b.json"], "prompts=[]: name one prompt set"),
    ("bench_unknown_set", "serving.bench", ["artifact={root}/artifact", "prompts=nosuch", "out={tmp}/b.json"], "prompt set not found: 'nosuch'"),
    ("bench_empty_prompt_file", "serving.bench", ["artifact={root}/artifact", "prompts={root}/files/empty.jsonl", "out={tmp}/b.json"], "holds no prompts"),
    ("bench_prompt_not_an_object", "serving.bench", ["artifact={root}/artifact", "prompts={root}/files/not_a_prompt.jsonl", "out={tmp}/b.json"], "not_a_prompt.jsonl:1: a prompt line must be a JSON object"),
    ("bench_binary_prompt_file", "serving.bench", ["artifact={root}/artifact", "prompts={root}/files/binary.json", "out={tmp}/b.json"], "binary.json is not UTF-8 JSONL"),
    ("serve_artifact_is_a_file", "serving.run", ["artifact={root}/artifact/config.json"], "is a file: pass the directory"),
    ("serve_topk_past_draft_vocab", "serving.run", ["artifact={root}/artifact", "draft=tree", "topk=100000"], "topk=100000: more children"),
    ("bench_engine_on_a_tree", "serving.bench", ["artifact={root}/artifact", "engine=vllm", "draft=tree", "out={tmp}/b.json"], "engine=vllm: draft=tree: an engine is compared"),
    ("bench_engine_head_missing", "serving.bench", ["artifact={root}/artifact", "engine=llamacpp", "engine_head={tmp}/no.gguf", "out={tmp}/b.json"], "engine_head={tmp}/no.gguf: no such file"),
    ("bench_engine_head_not_a_gguf", "serving.bench", ["artifact={root}/artifact", "engine=llamacpp", "engine_head={root}/artifact", "out={tmp}/b.json"], "llama.cpp serves a head .gguf file"),
    ("bench_unknown_spec_bench_category", "serving.bench", ["artifact={root}/artifact", "prompts=specbench/poetry", "out={tmp}/b.json"], "Spec-Bench has no category 'poetry'"),
    ("bench_same_set_twice", "serving.bench", ["artifact={root}/artifact", "prompts=[mtbench,mtbench]", "out={tmp}/b.json"], "names the same set twice"),
    ("serve_ngram_shortest_above_longest", "serving.run", ["artifact={root}/artifact", "draft=ngram", "ngram.shortest=5", "ngram.longest=2"], "ngram.shortest=5 is above ngram.longest=2"),
    ("serve_auto_schedule_on_a_tree", "serving.run", ["artifact={root}/artifact", "draft=tree", "schedule=auto"], "schedule=auto schedules chains"),
    ("serve_schedule_unknown", "serving.run", ["artifact={root}/artifact", "schedule=sometimes"], "schedule=sometimes: must be one of fixed | auto"),
    ("serve_unknown_ngram_key", "serving.run", ["artifact={root}/artifact", "draft=ngram", "+ngram.window=3"], "ngram.window: no such setting (the settings here: shortest, longest"),
    ("bench_unknown_key", "serving.bench", ["artifact={root}/artifact", "+drafts=3", "out={tmp}/b.json"], "drafts: no such setting"),
    ("serve_empty_prompt", "serving.run", ["artifact={root}/artifact", "prompt="], "prompt is empty"),
    ("bench_out_not_json", "serving.bench", ["artifact={root}/artifact", "out={tmp}/b.png"], "out={tmp}/b.png: must name a .json file"),
    ("serve_a_run_dir", "serving.run", ["artifact={run}"], "holds training checkpoints: pass one of them, e.g. {run}/checkpoints/latest"),
    ("bench_out_in_missing_dir", "serving.bench", ["artifact={root}/artifact", "out={tmp}/no/such/b.json"], "no directory"),
    ("bench_out_through_a_missing_dir", "serving.bench", ["artifact={root}/artifact", "out={tmp}/no/../b.json"], "no directory {tmp}/no/.."),
    ("bench_out_inside_checkpoint", "serving.bench", ["artifact={root}/artifact", "out={run}/checkpoints/step-2/b.json"], "would overwrite the training checkpoint"),
    ("bench_out_over_artifact", "serving.bench", ["artifact={root}/artifact", "out={root}/artifact/config.json"], "would overwrite"),
    # export: the four data-loss cases of issue 13, then more
    ("export_into_checkpoint_through_latest", "export.run", ["checkpoint={run}/checkpoints/latest", "out={run}/checkpoints/step-2", "overwrite=true"], "would overwrite the training checkpoint"),
    ("export_verifier_over_checkpoint", "export.run", ["checkpoint={run}/checkpoints/step-2", "format=speculators", "out={tmp}/x", "verifier_out={run}/checkpoints/step-2", "overwrite=true"], "verifier_out"),
    ("export_over_latest", "export.run", ["checkpoint={run}/checkpoints/step-2", "out={run}/checkpoints/latest", "overwrite=true"], "would overwrite"),
    ("export_over_run_dir", "export.run", ["checkpoint={root}/artifact", "out={run}", "overwrite=true"], "would overwrite the training checkpoints"),
    ("export_over_existing", "export.run", ["checkpoint={run}/checkpoints/latest", "out={root}/files"], "already exists"),
    ("import_onto_another_target", "export.run", ["checkpoint={root}/speculators", "out={tmp}/x", "target=tiny_llama",
                                                  "target.random_init.hidden_size=128", "target.random_init.head_dim=32"],
     "a head of hidden_size=64, made for another target: the target tiny-llama has hidden_size=128"),
    ("export_verifier_missing", "export.run", ["checkpoint={root}/artifact", "format=speculators", "out={tmp}/x", "verifier={tmp}/nope"], "no such model directory"),
    ("export_overwrite_a_folder_of_user_files", "export.run", ["checkpoint={root}/artifact", "out={root}/files", "overwrite=true"], "was not written by specdraft's export"),
    ("export_format_unknown", "export.run", ["checkpoint={run}/checkpoints/latest", "format=onnx", "out={tmp}/x"], "onnx"),
    ("export_unknown_key", "export.run", ["checkpoint={root}/artifact", "out={tmp}/x", "+formt=vllm"], "formt: no such setting"),
    ("export_steps_zero", "export.run", ["checkpoint={run}/checkpoints/latest", "out={tmp}/x", "steps=0"], "steps=0: must be >= 1"),
    ("export_no_checkpoint", "export.run", ["out={tmp}/x"], "checkpoint is required"),
    ("export_checkpoint_missing", "export.run", ["checkpoint={tmp}/nope", "out={tmp}/x"], "checkpoint not found"),
    ("export_corrupt_state", "export.run", ["checkpoint={root}/broken_checkpoint", "out={tmp}/x"], "is unreadable"),
    ("serve_seed_negative", "serving.run", ["artifact={root}/artifact", "seed=-1"], "seed=-1: must be >= 0"),
    ("serve_temperature_nan", "serving.run", ["artifact={root}/artifact", "temperature=nan"], "temperature=nan: must be a finite number >= 0"),
    ("serve_top_p_zero", "serving.run", ["artifact={root}/artifact", "temperature=0.7", "top_p=0"], "top_p=0: must be > 0 and <= 1"),
    ("serve_artifact_empty", "serving.run", ["artifact="], "artifact=: must not be empty"),
    ("export_out_empty", "export.run", ["checkpoint={root}/artifact", "out="], "out=: must not be empty"),
    ("run_dir_is_an_artifact", "training.run", ["hydra.run.dir={root}/artifact"], "would write into the artifact or model dir {root}/artifact"),
    ("run_dir_inside_a_model_dir", "training.run", ["hydra.run.dir={root}/model_dir/run"], "would write into the artifact or model dir {root}/model_dir"),
    ("bench_out_into_another_artifact", "serving.bench", ["artifact={root}/artifact", "out={root}/speculators/b.json"], "would write into the artifact or model dir {root}/speculators"),
    ("export_verifier_over_a_drafter", "export.run", ["checkpoint={run}/checkpoints/latest", "format=speculators", "out={tmp}/x", "verifier_out={root}/artifact", "overwrite=true"], "verifier_out {root}/artifact holds a drafter artifact, not a model dir"),
    ("export_over_a_target_model", "export.run", ["checkpoint={run}/checkpoints/latest", "out={root}/model_dir", "overwrite=true"], "out {root}/model_dir was not written by specdraft's export"),
    ("dflash_block_past_max_length", "training.run", ["drafter=dflash", "drafter.block_size=10000"], "drafter.block_size=10000: must be <= data.max_length=128"),
    ("data_not_a_regular_file", "training.run", ["data.path=/dev/null"], "data file is not a regular file: /dev/null"),
    ("bench_auto_schedule_with_min_confidence", "serving.bench", ["artifact={root}/artifact", "schedule=auto", "min_confidence=0.5", "out={tmp}/b.json"], "min_confidence=0.5 is for schedule=fixed"),
    ("launch_nodes_on_loopback", "training.launch", ["launch.nodes=2", "distributed=ddp", "launch.dry_run=true"], "launch.main_address=127.0.0.1: with launch.nodes=2, pass node 0's address"),
    ("seed_negative", "training.run", ["seed=-5"], "seed=-5: must be >= 0"),
    ("batch_past_the_data", "training.run", ["trainer.batch_size=1000000"], "trainer.batch_size=1000000: a micro-batch of 1000000 x 1 process(es) is more than the"),
    ("wandb_online_without_a_key", "training.run", ["logger=wandb", "logger.mode=online", "trainer.max_steps=2"], "logger.mode=online: no W&B API key"),
    # what Hydra itself refuses while composing (before any command of ours runs)
    ("plain_override_typo", "serving.run", ["artifact={root}/artifact", "total=0"], "total: no such setting (did you mean total_tokens?"),
    ("plain_override_typo_nested", "training.run", ["trainer.lrr=1"], "trainer.lrr: no such setting (did you mean lr? the settings here: max_steps"),
    ("export_plain_override_typo", "export.run", ["checkpoint={root}/artifact", "out={tmp}/x", "dtype=int8"], "dtype: no such setting (the settings here: drafter"),
    ("serve_group_it_does_not_have", "serving.run", ["artifact={root}/artifact", "target=llama"], "target: no such setting (the settings here: artifact"),
    ("drafter_unknown", "training.dump", ["drafter=nosuch"], "drafter=nosuch: must be one of dflash | dspark | eagle | eagle3"),
    ("override_unparsable", "training.launch", ["trainer.lr=[1"], "trainer.lr=[1: not a valid override"),
    ("override_ambiguous_list", "serving.bench", ["artifact={root}/artifact", "steps=1,2"], "Ambiguous value for argument 'steps=1,2'"),
    ("run_dir_is_a_file", "training.run", ["hydra.run.dir={root}/files/one.jsonl"], "hydra.run.dir {root}/files/one.jsonl: {root}/files/one.jsonl is not a directory"),
    ("run_dir_below_a_file", "training.run", ["hydra.run.dir={root}/files/one.jsonl/run"], "{root}/files/one.jsonl is not a directory"),
    ("run_dir_cannot_be_made", "serving.run", ["artifact={root}/artifact", "hydra.run.dir=/proc/specdraft/run"], "cannot make a directory in /proc"),
    ("run_dir_empty", "training.run", ["hydra.run.dir="], "hydra.run.dir=: must not be empty"),
    ("dump_cache_dir_a_file", "training.dump", ["data.cache.dir=/dev/null"], "data.cache.dir /dev/null: /dev/null is not a directory"),
    ("serve_seed_past_the_range", "serving.run", ["artifact={root}/artifact", "seed=99999999999"], "seed=99999999999: must be <= 4294967295 and >= 0"),
    ("serve_top_p_above_one", "serving.run", ["artifact={root}/artifact", "top_p=2"], "top_p=2: must be <= 1 and > 0"),
    # what overwrite=true may replace: only what export or a benchmark wrote
    ("export_over_a_project_with_a_config", "export.run", ["checkpoint={root}/artifact", "out={root}/files/project", "overwrite=true"], "out {root}/files/project was not written by specdraft's export"),
    ("export_over_a_model_without_tokenizer", "export.run", ["checkpoint={root}/artifact", "out={root}/files/model_no_tokenizer", "overwrite=true"], "was not written by specdraft's export"),
    ("export_verifier_over_a_user_model", "export.run", ["checkpoint={run}/checkpoints/latest", "format=speculators", "out={tmp}/x", "verifier_out={root}/model_dir", "overwrite=true"], "verifier_out {root}/model_dir was not written by specdraft's export"),
    ("bench_out_beside_a_users_yaml", "serving.bench", ["artifact={root}/artifact", "out={root}/files/exp.json"], "{root}/files/exp.yaml already exist"),
    ("bench_overwrite_a_users_json", "serving.bench", ["artifact={root}/artifact", "out={root}/files/notes.json", "overwrite=true"], "notes.json is not an earlier benchmark's result"),
    ("bench_out_over_a_run_record", "serving.bench", ["artifact={root}/artifact", "out={run}/.hydra/config.json", "overwrite=true"], "{run}/.hydra/config.yaml is not an earlier benchmark's result"),
    # run dirs a refused command must not even log into
    ("serve_run_dir_inside_a_checkpoint", "serving.run", ["artifact={root}/artifact", "hydra.run.dir={run}/checkpoints/step-2/serve"], "hydra.run.dir {run}/checkpoints/step-2/serve would overwrite the training checkpoint"),
    ("launch_dry_run_into_checkpoints", "training.launch", ["launch.dry_run=true", "hydra.run.dir={run}/checkpoints"], "is another run's checkpoints/ dir"),
    ("launch_dry_run_over_checkpoints", "training.launch", ["launch.dry_run=true", "hydra.run.dir={run}"], "trainer.resume=no: {run}/checkpoints already holds checkpoints"),
    ("dump_run_dir_inside_an_artifact", "training.dump", ["hydra.run.dir={root}/artifact/dump"], "would write into the artifact or model dir {root}/artifact"),
    # malformed artifacts: one line naming the field, never a traceback
    ("serve_config_not_an_object", "serving.run", ["artifact={root}/bad/config_list"], "config.json is not a JSON object"),
    ("serve_hparams_not_an_object", "serving.run", ["artifact={root}/bad/hparams_list"], "hparams must be a JSON object, not list"),
    ("serve_no_verifier", "serving.run", ["artifact={root}/bad/no_verifier"], "native artifact lacks field 'verifier'"),
    ("serve_vocab_size_text", "serving.run", ["artifact={root}/bad/vocab_size_text"], "verifier.vocab_size must be a positive integer, not 'big'"),
    ("serve_drafter_a_number", "serving.run", ["artifact={root}/bad/drafter_number"], "drafter must be a string, not int"),
    ("serve_drafter_unknown", "serving.run", ["artifact={root}/bad/drafter_unknown"], "unknown drafter 'eagle9'"),
    ("serve_hparams_incomplete", "serving.run", ["artifact={root}/bad/hparams_without_vocab"], "hparams do not describe a eagle3 drafter ('draft_vocab_size')"),
    ("serve_steps_text", "serving.run", ["artifact={root}/bad/steps_text"], "proposal.steps must be a positive integer, not 'x'"),
    ("serve_d2t_out_of_range", "serving.run", ["artifact={root}/bad/d2t_out_of_range"], "outside the target's vocabulary of"),
    ("serve_d2t_float", "serving.run", ["artifact={root}/bad/d2t_float"], "d2t must be int64 and t2d bool, not torch.float32"),
    ("export_t2d_int", "export.run", ["checkpoint={root}/bad/t2d_int", "out={tmp}/x"], "not torch.int64 and torch.int64"),
    ("serve_nan_weights", "serving.run", ["artifact={root}/bad/nan_weights"], "is not finite (NaN or inf)"),
    ("export_nan_weights", "export.run", ["checkpoint={root}/bad/nan_weights", "format=speculators", "out={tmp}/x"], "is not finite"),
    ("init_from_nan_weights", "training.run", ["drafter.init_from={root}/bad/nan_weights"], "nan_weights: weight"),
    ("bench_nan_weights", "serving.bench", ["artifact={root}/bad/nan_weights", "out={tmp}/b.json"], "is not finite"),
    # hidden-state caches: cut, foreign, missing or of another shape
    ("cache_shard_cut_short", "training.run", ["data.hidden_states=offline", "data.cache.dir={root}/caches/cut_shard"], "train-00000.safetensors is unreadable"),
    ("cache_shard_of_another_target", "training.run", ["data.hidden_states=offline", "data.cache.dir={root}/caches/foreign_shard"], "train-00000.safetensors is not one of this cache's: cache"),
    ("cache_shard_missing", "training.run", ["data.hidden_states=offline", "data.cache.dir={root}/caches/missing_shard"], "eval-00000.safetensors is missing"),
    ("cache_index_not_an_object", "training.run", ["data.hidden_states=offline", "data.cache.dir={root}/caches/index_list"], "index.json is not a cache index"),
    ("cache_index_cut_short", "training.run", ["data.hidden_states=offline", "data.cache.dir={root}/caches/index_cut"], "index.json is unreadable"),
    ("cache_of_another_shard_size", "training.run", ["data.hidden_states=offline", "data.cache.dir={root}/caches/other_shard_size"], "is not one of this cache's"),
    ("cache_resumed_dump_over_a_foreign_shard", "training.dump", ["data.cache.dir={root}/caches/foreign_shard"], "is not one of this cache's"),
    ("cache_of_another_target", "training.run", ["data.hidden_states=offline", "data.cache.dir={root}/cache_other_target"], "is stale: it holds target_fingerprint="),
]


@pytest.mark.parametrize("module,args,expected", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_and_touches_nothing(world, tmp_path, capsys, module, args, expected):
    before = snapshot(world)
    fresh_run = [] if any(a.startswith("hydra.run.dir") for a in args) or module not in (
        "training.run", "training.dump", "training.launch", "serving.run") else [f"hydra.run.dir={tmp_path / 'out'}"]
    tiny = TINY if module.startswith("training.") else []
    fill = dict(root=world, run=world / "run", tmp=tmp_path)
    result = run_cli(module, [*tiny, *fresh_run, *(a.format(**fill) for a in args)], capsys)
    code, output = result.returncode, result.stderr + result.stdout
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert len(errors) == 1, output[-3000:]
    assert expected.format(**fill) in errors[0], errors[0]
    assert snapshot(world) == before, "a bad input changed existing files"


def test_cases_cover_every_entry_point_and_class():
    assert len(CASES) >= 40
    assert {case[1] for case in CASES} == {"training.run", "training.launch", "training.dump", "serving.run",
                                           "serving.bench", "export.run"}


@pytest.mark.long
def test_bad_input_in_a_two_process_run_is_one_line(world, tmp_path):
    """The data file fails after the process group exists (in the main process, while the other
    waits for it): still one line from the main process, exit 2, no traceback from either process
    or from torchrun."""
    result = subprocess.run([sys.executable, "-m", "training.launch", *TINY, "distributed=ddp",
                             "launch.processes_per_node=2", f"hydra.run.dir={tmp_path / 'run'}",
                             f"data.path={world / 'files' / 'one.jsonl'}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"})
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert [line for line in output.splitlines() if line.startswith("error:")] == [
        next(line for line in output.splitlines() if "1 usable conversation(s)" in line)], output[-3000:]


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_during_export_keeps_the_previous_artifact(world, tmp_path, seed):
    out = tmp_path / "artifact"
    shutil.copytree(world / "artifact", out)
    before = snapshot(out)
    delay = random.Random(seed).uniform(0.0, 0.05)  # while the new artifact is being written or renamed
    killed = kill_while_writing([sys.executable, "-m", "export.run", f"out={out}", "overwrite=true",
                                 f"checkpoint={world / 'run' / 'checkpoints' / 'step-2'}"], delay, str(tmp_path / ".artifact.*"))
    read(str(out)).build(str(out))  # the old artifact or the new one, whole
    assert killed or snapshot(out) != before
    assert snapshot(out) == before or read(str(out)).hparams == read(str(world / "run" / "checkpoints" / "step-2")).hparams
    result = subprocess.run([sys.executable, "-m", "export.run", f"checkpoint={world / 'artifact'}", f"out={out}",
                             "overwrite=true"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["artifact"], "a killed export's temp dir was not cleaned up"
