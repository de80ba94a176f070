"""scripts/ablate.py: rows trained at one budget and benched into one table, resumable."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "ablate.py")


def ablate_module():
    spec = importlib.util.spec_from_file_location("ablate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_share_a_hidden_state_cache_unless_they_change_what_it_holds():
    key = ablate_module().cache_key
    assert key([]) == key(["trainer.lr=3e-4"]) == key(["drafter.ttt_steps=3", "drafter.loss=tv"]) == "shared"
    assert key(["data.max_samples=500"]) not in ("shared", key(["data.regenerate=false"]))
    assert key(["drafter.aux_layers=[1,2,3]"]) != "shared" and key(["drafter.num_aux=1"]) != "shared"
    assert key(["seed=1", "trainer.lr=1"]) == key(["seed=1"])


@pytest.mark.parametrize("content, named", [(None, "No such file"), ("rows: [a, b]\n", "needs minutes, train, bench, rows"),
                                             ("minutes: [\n", "--config")])
def test_a_missing_or_malformed_plan_is_one_line(tmp_path, content, named):
    config = tmp_path / "plan.yaml"
    if content is not None:
        config.write_text(content)
    result = subprocess.run([sys.executable, SCRIPT, "--config", str(config), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and named in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.long
def test_each_row_is_trained_benched_and_tabled_once(tmp_path):
    plan = {"minutes": 0.1,
            "train": ["drafter=eagle3", "target=tiny_llama", "logger=none", "data.max_samples=40", "data.max_length=160",
                      "trainer.batch_size=2", "trainer.eval_max_samples=8", "trainer.warmup_steps=2",
                      # real acceptance every 2 steps: each row's learning curve (the plan's eval_every wins)
                      "trainer.eval_every=2", "trainer.eval_accept_prompts=2", "trainer.eval_accept_tokens=8",
                      f"cache_dir={tmp_path / 'cache'}"],
            "bench": ["prompts=mtbench", "n=2", "max_new_tokens=8", "draft=chain", "steps=2"],
            "rows": {"baseline": [], "fewer": ["data.max_samples=30"], "broken": ["drafter.loss=nope"]}}
    config = tmp_path / "plan.yaml"
    config.write_text(yaml.safe_dump(plan, sort_keys=False))
    out = tmp_path / "out"
    command = [sys.executable, SCRIPT, "--config", str(config), "--out", str(out)]
    first = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert first.returncode == 1, first.stderr[-3000:]  # the broken row failed, the others went on
    table = json.loads((out / "table.json").read_text())
    assert list(table["rows"]) == ["baseline", "fewer", "broken"]
    assert "drafter.loss=nope" in table["rows"]["broken"]["error"]
    for name in ("baseline", "fewer"):
        row = table["rows"][name]
        assert row["steps"] >= 1 and row["train_minutes"] > 0
        assert row["sim_accept_len"] >= 1
        assert list(row["accept_len"]) == ["mtbench"] and 1 <= row["accept_len"]["mtbench"] <= 3
        bench = json.loads((out / "rows" / name / "bench.json").read_text())
        assert bench["datasets"]["mtbench"]["accept_len"] == row["accept_len"]["mtbench"]
    assert sorted(os.listdir(out / "hidden")) == sorted(["shared", ablate_module().cache_key(["data.max_samples=30"])])
    markdown = (out / "table.md").read_text()
    assert all(f"| {name} |" in markdown for name in plan["rows"])
    curves = json.loads((out / "curves.json").read_text())
    assert sorted(curves) == ["baseline", "fewer"] and (out / "curves.png").stat().st_size > 0
    for name, curve in curves.items():
        row, tokens = table["rows"][name], curve["tokens"]
        assert len(tokens) >= 2 and tokens == sorted(set(tokens))  # every 2 steps, and the last
        assert all(1 <= a <= 8 for a in curve["accept_len"])
        assert curve["break_even"] == pytest.approx(row["accept_len"]["mtbench"] / row["speedup"]["mtbench"])
        assert curve["pays_from_tokens"] == next((t for t, a in zip(tokens, curve["accept_len"]) if a > curve["break_even"]), None)

    trained = (out / "rows" / "baseline" / "trained.json").stat().st_mtime_ns
    again = subprocess.run([*command, "--rows", "baseline", "fewer"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 1, again.stderr[-3000:]  # the table still holds the failed row
    assert "[1/" not in again.stdout  # nothing left to run
    assert (out / "rows" / "baseline" / "trained.json").stat().st_mtime_ns == trained
    assert json.loads((out / "table.json").read_text()) == table

    # rows measured on another kind of machine are not mixed in: their budget bought other training
    (out / "table.json").write_text(json.dumps({**table, "machine": "another machine"}))
    elsewhere = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert elsewhere.returncode == 2 and "on another machine, not on this" in elsewhere.stderr
    assert len(elsewhere.stderr.strip().splitlines()) == 1
