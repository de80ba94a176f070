"""drafters/storage/writes.py on its own: what a reader sees of a write (the file whole, with the umask's
permissions), and what the next writer does with what a killed one left."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from drafters.config.errors import UserError
from drafters.storage.writes import UMASK, atomic_directory, atomic_file, remove_stale_partials, temp_beside


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_safetensors_files_get_the_umask_permissions_not_0600(tmp_path):
    """safetensors creates its files 0600; an artifact must be readable by a server of another user."""
    with atomic_directory(str(tmp_path / "artifact")) as partial:
        save_file({"w": torch.zeros(2)}, os.path.join(partial, "model.safetensors"))
    with atomic_file(str(tmp_path / "vocab.safetensors")) as partial:
        save_file({"w": torch.zeros(2)}, partial)
    for path in (tmp_path / "artifact" / "model.safetensors", tmp_path / "vocab.safetensors"):
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~UMASK


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(str(path)) as partial:
            open(partial, "w").write("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]


def test_what_a_killed_writer_left_is_cleaned_and_a_moved_aside_dir_put_back(tmp_path):
    out = tmp_path / "artifact"
    pid = dead_pid()
    # killed between moving the old artifact aside and renaming the new one in
    old = tmp_path / f".artifact.old-{pid}-0123abcd"
    old.mkdir()
    (old / "config.json").write_text("old")
    (tmp_path / f".artifact.partial-{pid}-4567cdef").mkdir()
    live = temp_beside(str(out))  # this process's: still being written, left alone
    os.mkdir(live)
    remove_stale_partials(str(out))
    assert (out / "config.json").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == sorted(["artifact", os.path.basename(live)])


def test_an_existing_file_is_not_replaced_by_a_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(UserError, match="is a file or a link"):
        with atomic_directory(str(tmp_path / "model.safetensors"), overwrite=True):
            pass
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"
