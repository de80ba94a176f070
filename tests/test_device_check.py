"""scripts/device_check.sh --smoke: the GPU check's own code, on CPU with a tiny target (issue 17),
so that the script a GPU session runs once is known to work before it gets there."""

import json
import os
import subprocess

import pytest

from conftest import ROOT


@pytest.mark.long
def test_device_check_smoke(tmp_path):
    result = subprocess.run(["bash", "scripts/device_check.sh", "--smoke", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert {row["kernel"] for row in report["kernels"]} == {"greedy_verify", "rejection_verify", "compact_kv"}
    assert all(row["identical"] for row in report["kernels"]), report["kernels"]
    assert all(row["triton_us"] > 0 and row["torch_us"] > 0 and row["floor_us"] > 0 for row in report["kernels"])
    for drafter in ("eagle3", "dflash", "head"):
        assert report["training"][drafter]["steps"] >= 2 and report["training"][drafter]["tokens_per_s"] > 0
    assert set(report["bench"]) == {"chain7", "tree"}
    for run in report["bench"].values():
        assert set(run["sets"]) == {"mtbench", "humaneval", "gsm8k"}
        assert all(s["unexplained_divergences"] == 0 for s in run["sets"].values()), run
    assert (tmp_path / "head" / "checkpoints" / "latest" / "model.safetensors").is_file()
    assert "| greedy_verify |" in (tmp_path / "device_check.md").read_text()
