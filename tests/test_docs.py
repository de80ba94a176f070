"""The docs stay true: the CLI reference is what conf/ generates, every link lands, and the "add a
drafter" walkthrough, done as written in a copy of the repository, trains, serves losslessly and exports."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT

DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(ROOT, "docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))


def cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", os.path.join(ROOT, "scripts", "cli_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_what_conf_generates():
    with open(os.path.join(ROOT, "docs", "cli.md")) as handle:
        written = handle.read()
    assert written == cli_reference().render(), "docs/cli.md is stale: run python scripts/cli_reference.py"


def test_every_setting_is_described():
    """Each key of every command and config group has a description in docs/cli.md (a comment in
    conf/, where the key is set or where the key it overrides is)."""
    cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in cli_reference().render().splitlines() if line.startswith("| `")]
    assert cells and all(len(row) == 4 for row in cells)  # key, default, allowed, what
    assert [row[0].strip() for row in cells if not row[3].strip()] == []


def anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    with open(path) as handle:
        headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", handle.read(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_lands_on_a_file_and_heading():
    broken = []
    for doc in DOCS:
        with open(doc) as handle:
            text = re.sub(r"```.*?```", "", handle.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            where = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(where) or (anchor and anchor not in anchors(where)):
                broken.append(f"{os.path.relpath(doc, ROOT)}: {target}")
    assert broken == []


def test_readme_is_short():
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= 12_000  # depth goes to docs/


def walkthrough_files() -> dict[str, str]:
    """The files docs/adding-a-drafter.md writes: each code block under a heading naming a path."""
    with open(os.path.join(ROOT, "docs", "adding-a-drafter.md")) as handle:
        text = handle.read()
    return {path: body for path, body in re.findall(r"^## \d\. .*?`([\w/]+\.(?:py|yaml))`\n.*?```\w+\n(.*?)```", text,
                                                    re.S | re.M)}


def test_adding_a_drafter_takes_one_module_and_one_yaml(tmp_path):
    files = walkthrough_files()
    assert sorted(files) == ["conf/drafter/lookahead.yaml", "drafters/lookahead.py"]
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "outputs", "multirun", "__pycache__",
                                                              "*.egg-info", ".pytest_cache", "wandb"))
    for path, body in files.items():
        assert not (repo / path).exists()
        (repo / path).write_text(body)
    run_dir, artifact = tmp_path / "run", tmp_path / "artifact"

    def run(*command):
        result = subprocess.run([sys.executable, "-m", *command], cwd=repo, capture_output=True, text=True, timeout=600,
                                env={**os.environ, "WANDB_MODE": "offline"})
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    run("training.run", "drafter=lookahead", "target=tiny_llama", "logger=none", "data.max_samples=24",
        "data.max_length=96", "trainer.batch_size=2", "trainer.max_steps=2", "trainer.eval_max_samples=2",
        f"hydra.run.dir={run_dir}")
    served = run("serving.run", f"artifact={run_dir}/checkpoints/latest", "max_new_tokens=12", "dtype=float32",
                 f"hydra.run.dir={tmp_path / 'serve'}")
    assert "identical output: True" in served
    run("export.run", f"checkpoint={run_dir}/checkpoints/latest", "format=native", f"out={artifact}")
    assert (artifact / "model.safetensors").exists() and '"drafter": "lookahead"' in (artifact / "config.json").read_text()
