"""drafters/storage/writes.py on its own: what a reader sees of a write (the file whole, with the umask's
permissions), and what the next writer does with what a killed one left."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from drafters.config.errors import UserError
from drafters.storage.writes import (MARK_FILE, UMASK, atomic_directory, atomic_file, check_not_owned, owned,
                                     remove_stale_partials, temp_beside)


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


def test_a_directory_another_process_wrote_meanwhile_is_not_replaced(tmp_path):
    """Two exports to one new `out` at once: the later one is refused at its rename, the earlier's stays."""
    out = tmp_path / "artifact"
    with pytest.raises(UserError, match="already exists"):
        with atomic_directory(str(out)) as partial:
            (tmp_path / "artifact").mkdir()  # the other export finished first
            (out / "config.json").write_text("theirs")
            open(os.path.join(partial, "config.json"), "w").write("mine")
    assert (out / "config.json").read_text() == "theirs" and sorted(os.listdir(tmp_path)) == ["artifact"]


def test_a_file_another_process_wrote_meanwhile_is_not_replaced_unless_asked(tmp_path):
    path = tmp_path / "bench.json"
    with pytest.raises(UserError, match="was written by another process meanwhile"):
        with atomic_file(str(path), replace=False) as partial:
            path.write_text("theirs")
            open(partial, "w").write("mine")
    assert path.read_text() == "theirs" and os.listdir(tmp_path) == ["bench.json"]


def test_overwrite_replaces_only_what_export_wrote(tmp_path):
    with atomic_directory(str(tmp_path / "artifact")) as partial:
        open(os.path.join(partial, "config.json"), "w").write("first")
    with atomic_directory(str(tmp_path / "artifact"), overwrite=True) as partial:  # its own mark: replaced
        open(os.path.join(partial, "config.json"), "w").write("second")
    assert (tmp_path / "artifact" / "config.json").read_text() == "second"
    with pytest.raises(UserError, match="holds a drafter artifact, not a model dir"):
        with atomic_directory(str(tmp_path / "artifact"), overwrite=True, model=True):
            pass
    os.remove(tmp_path / "artifact" / MARK_FILE)  # as a user's own dir with a config.json would be
    with pytest.raises(UserError, match="was not written by specdraft's export"):
        with atomic_directory(str(tmp_path / "artifact"), overwrite=True):
            pass
    assert (tmp_path / "artifact" / "config.json").read_text() == "second"


def test_a_run_dir_is_held_by_one_process_and_freed_when_it_ends(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; from drafters.storage.writes import owned, record_owner\n"
                               f"with owned({str(tmp_path)!r}, 'hydra.run.dir'):\n record_owner({str(tmp_path)!r})\n"
                               " print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"in use by a run still going \\(pid {holder.pid}"):
            check_not_owned(str(tmp_path), "hydra.run.dir")
        with pytest.raises(UserError, match="in use by a run still going"):
            with owned(str(tmp_path), "hydra.run.dir"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with owned(str(tmp_path), "hydra.run.dir"):  # a killed holder leaves nothing stuck
        elsewhere = subprocess.run([sys.executable, "-c", "from drafters.storage.writes import check_not_owned\n"
                                   f"check_not_owned({str(tmp_path)!r}, 'k')"], capture_output=True, text=True)
        assert "in use by a run still going" in elsewhere.stderr
