"""Who holds a run's locks, whether that process still lives, and the claim on an output path.

A holder is recorded as its pid, the kernel's start time of that pid (a pid reused by another
process has another start time) and its work dir. ``status`` uses it to tell a dead run from a
live one; the output claim uses it to name the other run in its refusal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Required, TypedDict, cast

from quark_ptq_eval.base.errors import QpeError, UsageError, WorkdirLocked


def process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot, /proc/PID/stat field 22); None
    when the process does not exist or the platform has no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie is gone: only its exit status is left


class Holder(TypedDict, total=False):
    """A lock file's record of the process holding it (an older "pid N" line gives only ``pid``)."""

    pid: Required[int]
    start: str | None  # the kernel's start time of pid (None: not known)
    workdir: str
    started_at: str


def holder_record(workdir: Path) -> Holder:
    pid = os.getpid()
    return {"pid": pid, "start": process_start(pid), "workdir": str(workdir),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def read_holder(text: str) -> Holder | None:
    """A lock file's holder record; an older "pid N" line is read too; None when empty."""
    text = text.strip()
    if text.startswith("{"):
        with contextlib.suppress(ValueError):
            record = json.loads(text)
            return cast(Holder, record) if isinstance(record, dict) else None  # its pid checked where it is used
    if text.startswith("pid "):
        with contextlib.suppress(ValueError):
            return Holder(pid=int(text.split()[1]), start=None)
    return None


def holder_alive(record: Holder | None) -> bool:
    """Does the recorded holder still run (the same process, not a reuse of its pid)?"""
    if not record or not isinstance(record.get("pid"), int):
        return False
    start = process_start(record["pid"])
    if start is None:
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return record.get("start") is None  # no /proc: the pid exists, trust it
    return record.get("start") in (None, start)


def open_lock_file(path: Path) -> int:
    """A lock file's descriptor, created if need be; O_NOFOLLOW: a lock file planted as a symlink
    must not make us write to its target."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise UsageError(f"Cannot use the lock file {path}: {exc.strerror or exc}.",
                         "Remove it if it is a symlink or not a regular file, then re-run.") from None


def claim_path(output_dir: Path) -> Path:
    """The lock file next to the output (the output itself need not exist yet)."""
    return output_dir.with_name(f".{output_dir.name}.quark-ptq-eval.lock")


class OutputClaim:
    """The output path claimed for one run's lifetime: a second run aimed at it is refused (exit 5)
    naming the holder. The lock file is removed on release; a holder that died leaves a file whose
    lock the kernel dropped, and the next run takes it over."""

    def __init__(self, output_dir: Path, workdir: Path):
        self.path, self.workdir = claim_path(Path(output_dir)), Path(workdir)
        self._fd: int | None = None
        self.output_dir = Path(output_dir)

    def __enter__(self) -> OutputClaim:
        for _ in range(5):  # the file may be unlinked by its releasing holder between open and lock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder: Holder | dict[str, str] = read_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace")) or {}
                os.close(fd)
                raise WorkdirLocked(
                    f"Another quark-ptq-eval run (work dir {holder.get('workdir', '?')}, pid {holder.get('pid', '?')}) "
                    f"is writing the output {self.output_dir}.",
                    "Wait for it to finish, or choose another -o.") from None
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder_record(self.workdir)).encode(), 0)
                self._fd = fd
                return self
            os.close(fd)
        raise QpeError(f"Could not claim the output {self.output_dir}: its lock file {self.path} keeps changing.",
                       "Check whether other runs target it, then re-run.")

    def _open(self) -> int:
        return open_lock_file(self.path)

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still locked: a waiter that opened it sees another inode and retries
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def make_staging(staging: Path) -> None:
    """Create the engine's staging directory exclusively: it must be this run's alone."""
    try:
        staging.mkdir()
    except FileExistsError:
        raise WorkdirLocked(f"The staging directory {staging} appeared while this run prepared it.",
                            "Another run may target the same output; wait for it or choose another -o.") from None


def rename_no_replace(src: Path, dst: Path) -> None:
    """Move the verified staging dir to the output, never over something that appeared there."""
    if dst.is_dir() and not any(dst.iterdir()):
        with contextlib.suppress(OSError):
            dst.rmdir()  # an empty directory the user made for the output: nothing in it to lose
    if os.path.lexists(dst):
        raise QpeError(f"The output {dst} appeared while the engine ran; the verified result stays in {src}.",
                       "Move one of them aside and re-run (nothing was overwritten).")
    try:
        _renameat2_noreplace(src, dst)
    except FileExistsError:
        raise QpeError(f"The output {dst} appeared while the engine ran; the verified result stays in {src}.",
                       "Move one of them aside and re-run (nothing was overwritten).") from None


def _renameat2_noreplace(src: Path, dst: Path) -> None:
    """rename(2) with RENAME_NOREPLACE where the C library has renameat2 (Linux), else rename."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    func = getattr(libc, "renameat2", None)
    if func is None:
        os.rename(src, dst)
        return
    at_fdcwd, noreplace = -100, 1
    if func(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), noreplace) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(dst))
    if err in (errno.EINVAL, errno.ENOSYS):  # a file system without RENAME_NOREPLACE
        os.rename(src, dst)
        return
    raise OSError(err, os.strerror(err), str(src))
