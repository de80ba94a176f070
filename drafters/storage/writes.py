"""Guarded writes: the one way this project puts anything on disk that a later run reads.

Every writer (artifacts, checkpoints, caches, vocabularies, benchmark results, dumps) goes through
`atomic_file` or `atomic_directory`:
- the destination is checked first (`check_destination`): symlinks followed, it must not be,
  contain or lie inside what the command reads, or any training checkpoint;
- it is written under a unique temp name beside it (pid + random), fsynced, then renamed into
  place: a reader sees the old file or the new one, never half of one;
- its files get the permissions the umask gives (safetensors writes 0600 whatever the umask, which
  would hide an artifact from a server running as another user);
- temp files an earlier, killed process left beside it are removed (their pid is gone);
- a directory it replaces must be one it wrote (`specdraft.json` says which kind), and a write the
  disk has no room for is one line naming the file (`no_space`), the partial write removed.
A training run holds its run dir (`owned`: a lock the kernel frees when the process dies).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import tempfile
import uuid
from contextlib import contextmanager

from drafters.config.errors import UserError

STATE_FILE = "trainer_state.json"  # what marks a directory as a training checkpoint
PARTIAL, OLD = ".partial-", ".old-"  # temp names: what is being written, what it replaces
UMASK = os.umask(0o022)  # read once (setting it is the only way to read it), then put back
os.umask(UMASK)


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def check_destination(out: str, protect: tuple[str, ...] = (), key: str = "out") -> None:
    """Refuse, before any work, a destination `out` (the setting `key`) that, symlinks followed, is,
    contains or lies inside one of the `protect`ed paths (what the command reads) or any training
    checkpoint."""
    real = os.path.realpath(out)
    for path in protect:
        source = os.path.realpath(path)
        if _within(real, source) or _within(source, real):
            raise UserError(f"{key} {out} would overwrite {path}" + (f" (both are {source})" if real == source else ""))
    check_not_in_saved(out, key, may_be_model_dir=True)  # export overwrite=true replaces an artifact
    for inner in (real, os.path.join(real, "checkpoints")):  # out holds a run's checkpoints (run dir or its checkpoints/)
        if holds_checkpoints(inner):
            raise UserError(f"{key} {out} would overwrite the training checkpoints in {inner}")


def holds_checkpoints(directory: str) -> bool:
    return os.path.isdir(directory) and any(os.path.isfile(os.path.join(directory, entry, STATE_FILE))
                                            for entry in os.listdir(directory))


def is_model_dir(directory: str) -> bool:
    """An artifact or HF model dir: a config.json beside safetensors weights."""
    return (os.path.isfile(os.path.join(directory, "config.json"))
            and any(entry.endswith(".safetensors") for entry in os.listdir(directory)))


def check_not_in_saved(path: str, key: str, may_be_model_dir: bool = False) -> None:
    """Refuse a `path` that, symlinks followed, is or lies inside a training checkpoint, or lies
    inside (or, unless `may_be_model_dir`, is) an artifact or model dir."""
    real = probe = os.path.realpath(path)
    while True:
        if os.path.isfile(os.path.join(probe, STATE_FILE)):
            raise UserError(f"{key} {path} would overwrite the training checkpoint {probe}")
        if os.path.isdir(probe) and (probe != real or not may_be_model_dir) and is_model_dir(probe):
            raise UserError(f"{key} {path} would write into the artifact or model dir {probe}")
        if os.path.dirname(probe) == probe:
            break
        probe = os.path.dirname(probe)


def check_run_dir(run_dir: str, model_dir_ok: bool = False) -> None:
    """Refuse a command's run dir (`hydra.run.dir`) inside a checkpoint or an artifact, or a run's
    checkpoints/ dir (`model_dir_ok`: the run dir may itself be a model dir, as the cwd a benchmark logs to)."""
    check_not_in_saved(run_dir, "hydra.run.dir", may_be_model_dir=model_dir_ok)
    if holds_checkpoints(run_dir):
        raise UserError(f"hydra.run.dir {run_dir} is another run's checkpoints/ dir: give the run dir above it")


def check_writable(out: str, key: str = "out") -> None:
    """Refuse, before any work, a file destination whose directory is missing or not writable."""
    directory = os.path.dirname(out) or "."  # not normalized: `missing/../b.json` must fail here, as its write would
    if not os.path.isdir(directory):
        raise UserError(f"{key} {out}: no directory {directory} to write into")
    if not os.access(directory, os.W_OK):
        raise UserError(f"{key} {out}: directory {directory} is not writable")
    if os.path.isdir(out):
        raise UserError(f"{key} {out} is a directory, not a file")


def check_creatable(directory: str, key: str) -> None:
    """Refuse a directory destination that cannot be made: its nearest existing ancestor must be a
    directory this process can create entries in (a probe, not `os.access`: root passes that
    everywhere, /proc included)."""
    path = os.path.abspath(directory)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise UserError(f"{key} {directory}: {path} is not a directory")
    if path != os.path.abspath(directory):
        try:
            os.rmdir(tempfile.mkdtemp(dir=path, prefix=".specdraft-probe-"))
        except OSError as error:
            raise UserError(f"{key} {directory}: cannot make a directory in {path} ({error.strerror})") from None


def temp_beside(path: str, kind: str = PARTIAL) -> str:
    """A name no other process uses, beside `path`, hidden, marked with its `kind`."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{kind}{os.getpid()}-{uuid.uuid4().hex[:8]}")


TEMP_NAME = re.compile(r"\.(?P<name>.+)(?P<kind>\.partial-|\.old-)(?P<pid>\d+)-[0-9a-f]{8}")


def remove_stale_partials(path: str, every_name: bool = False) -> None:
    """Clean up beside `path` (`every_name`: in the directory `path`, for every file) after killed
    processes; a live process's temp names are left alone. What they were writing is deleted; if
    one died between moving the old file aside and renaming the new one in, the old one is put back."""
    parent, wanted = (path, None) if every_name else os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):
        return
    for entry in sorted(os.listdir(parent)):
        found = TEMP_NAME.fullmatch(entry)
        if not found or wanted not in (None, found["name"]) or _alive(int(found["pid"])):
            continue
        stale, original = os.path.join(parent, entry), os.path.join(parent, found["name"])
        if found["kind"] == OLD and not os.path.lexists(original):
            os.replace(stale, original)
        elif os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.remove(stale)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def seal(path: str) -> None:
    """A written file, or every file of a written dir, with the umask's permissions and on disk."""
    files = [os.path.join(root, name) for root, _dirs, names in os.walk(path) for name in names] \
        if os.path.isdir(path) else [path]
    for file in files:
        os.chmod(file, 0o666 & ~UMASK)
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    if os.path.isdir(path):  # its entries too
        _fsync_directory(path)


def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def out_of_space(error: BaseException) -> bool:
    """A write the system refused for lack of space (a full disk, a quota, a file size limit); torch
    and safetensors wrap that OSError in exceptions of their own, known by their text."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    return any(phrase in str(error) for phrase in ("No space left", "Disk quota exceeded", "File too large",
                                                    "file write failed"))


def no_space(key: str, path: str, kept: str = "nothing was replaced") -> UserError:
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    free = shutil.disk_usage(parent).free / 2**20
    return UserError(f"{key} {path}: no space left on the device ({free:.1f} MiB free there); {kept}")


@contextmanager
def atomic_file(path: str, protect: tuple[str, ...] = (), key: str = "out", replace: bool = True):
    """Yield a temp path beside `path` to write the whole file to; it becomes `path` once the body
    succeeded (fsynced first), replacing it (or, without `replace`, only where no other process made
    it meanwhile), and is removed if it failed."""
    check_destination(path, protect, key)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    remove_stale_partials(path)
    partial = temp_beside(path)
    try:
        yield partial
        seal(partial)
        if replace:
            os.replace(partial, path)
        else:
            try:
                os.link(partial, path)  # atomic, and fails where the name exists
            except FileExistsError:
                raise UserError(f"{key} {path} was written by another process meanwhile; nothing replaced") from None
    except Exception as error:
        if out_of_space(error):
            raise no_space(key, path) from None
        raise
        _fsync_directory(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.lexists(partial):
            os.remove(partial)


MARK_FILE = "specdraft.json"  # in every dir export.run writes: what it is; `overwrite=true` replaces only such dirs
KINDS = {False: "drafter artifact", True: "model dir"}  # atomic_directory's `model` -> what it writes


def check_directory_destination(out: str, overwrite: bool = False, protect: tuple[str, ...] = (), key: str = "out",
                                model: bool = False) -> None:
    """What `atomic_directory` refuses, checked on its own so that a command can refuse it before any work."""
    check_destination(out, protect, key)
    out = os.path.abspath(out)
    if os.path.lexists(out) and not overwrite:
        raise UserError(f"{key} {out} already exists (remove it, or pass overwrite=true to replace it "
                        "once the new one is completely written)")
    if os.path.islink(out) or os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"{key} {out} is a file or a link, not a directory it can replace")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if not held:
        return
    written = read_mark(out)
    if written is None:  # a user's folder, their model, anything export.run did not write
        raise UserError(f"{key} {out} was not written by specdraft's export (no {MARK_FILE}; it holds "
                        f"{', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): overwrite=true replaces only "
                        "what export wrote; remove it yourself or choose another dir")
    if written != KINDS[model]:
        raise UserError(f"{key} {out} holds a {written}, not a {KINDS[model]}: overwrite=true replaces only a {KINDS[model]}")


def read_mark(directory: str) -> str | None:
    """What export wrote in `directory` (a KINDS value), or None where it did not write it."""
    try:
        with open(os.path.join(directory, MARK_FILE)) as handle:
            kind = json.load(handle).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS.values() else None


@contextmanager
def atomic_directory(out: str, overwrite: bool = False, protect: tuple[str, ...] = (), key: str = "out",
                     model: bool = False):
    """Yield an empty temp dir beside `out` that becomes `out` by rename once the body succeeded.

    An existing `out` is refused, or with `overwrite` (when it is empty or of the kind written and
    marked as written here: a drafter artifact, or with `model` a model dir) replaced only after the
    new one is complete (old moved aside, new renamed in, old deleted): `out` is never half-written,
    and a failure removes the temp dir and leaves `out` as it was. `out` is checked first
    (`check_destination`), and again at the end: another process may have written it meanwhile.
    """
    check_directory_destination(out, overwrite, protect, key, model)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    remove_stale_partials(out)
    partial = temp_beside(out)
    os.mkdir(partial)
    try:
        yield partial
        with open(os.path.join(partial, MARK_FILE), "w") as handle:
            json.dump({"kind": KINDS[model], "written_by": "specdraft export.run"}, handle)
        seal(partial)
        check_directory_destination(out, overwrite, protect, key, model)
        commit_directory(partial, out)
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        if out_of_space(error):
            raise no_space(key, out) from None
        raise


def commit_directory(partial: str, out: str) -> None:
    """Rename the complete dir `partial` to `out`, replacing an existing `out` only once the new
    one is in place (old moved aside under a temp name, deleted last)."""
    if os.path.lexists(out):
        old = temp_beside(out, OLD)
        os.replace(out, old)
        try:
            os.replace(partial, out)
        except OSError:
            os.replace(old, out)  # put the old one back
            raise
        shutil.rmtree(old)
    else:
        os.replace(partial, out)
    _fsync_directory(os.path.dirname(os.path.abspath(out)))


LOCK_FILE = ".specdraft.lock"  # held (flock) by the process that owns a run dir; the kernel frees it when that process dies


@contextmanager
def owned(directory: str, key: str):
    """Hold the run dir `directory` for the body, or refuse it (the setting `key`) while another live
    process holds it. A crashed process leaves nothing stuck: its lock dies with it."""
    os.makedirs(directory, exist_ok=True)
    descriptor = _lock(directory, key)
    try:
        yield
    finally:
        os.close(descriptor)


def record_owner(directory: str) -> None:
    """Write who holds `directory` into its lock file, once the run's checks have passed (a refused
    run changes nothing), for the line that refuses the next one."""
    with open(os.path.join(directory, LOCK_FILE), "w") as handle:  # the same file: the lock stays
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}, handle)


def check_not_owned(directory: str, key: str) -> None:
    """Refuse `directory` while a live process holds it (`owned`), taking nothing."""
    if os.path.isfile(os.path.join(directory, LOCK_FILE)):
        os.close(_lock(directory, key))


def _lock(directory: str, key: str) -> int:
    """An open descriptor of `directory`'s lock file, locked for this process, or a UserError naming the holder."""
    descriptor = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666 & ~UMASK)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(descriptor, 4096).decode("utf-8", "replace")
        os.close(descriptor)
        try:
            holder = ", ".join(f"{name} {value}" for name, value in json.loads(holder).items())
        except (ValueError, AttributeError):  # not written yet: the holder is still checking its input
            holder = "another process"
        raise UserError(f"{key} {os.path.abspath(directory)} is in use by a run still going ({holder}): wait for it to "
                        "end, or choose another dir") from None
    return descriptor
