"""Crash-safe file writes and friendly reads.

Every artifact is written to a temporary file in the same directory, fsynced, then renamed
over the target, so a reader (or a resumed run) sees either the old file or the new one,
never half of one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import QpeError, UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_JSON_BYTES = 256 * 1024 * 1024


class DiskFullError(QpeError):
    pass


def write_png(fig: Figure, path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """Render a matplotlib figure to PNG and write it atomically; the figure is closed."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _write_error(path, exc, len(data)) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, umask_mode())  # mkstemp makes 0600; artifacts get the usual mode
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a power loss
    except OSError as exc:
        _unlink_quietly(tmp)
        raise _write_error(path, exc, len(data)) from None
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return path


def current_umask() -> int:
    """This process's umask: read from /proc where it says (never changed), else set and put back."""
    with contextlib.suppress(OSError):
        found = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.MULTILINE)
        if found:
            return int(found.group(1), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(is_dir: bool = False, umask: int | None = None) -> int:
    """The mode ``cp`` gives a new file (0666 & ~umask) or folder (0777 & ~umask)."""
    return (0o777 if is_dir else 0o666) & ~(current_umask() if umask is None else umask)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_error(path: Path, exc: OSError, size: int) -> QpeError:
    """One sentence naming the file (and, when space ran out, the space needed and where to free it)."""
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return DiskFullError(f"Could not write {path}: {os.strerror(exc.errno)} ({size} bytes needed).",
                             space_hint(path.parent, size, exc.errno))
    return QpeError(f"Could not write {path}: {exc.strerror or exc}.",
                    "Check that the directory is writable and its file system healthy, then re-run.")


def space_hint(directory: Path, size: int, err: int | None) -> str:
    """What to free (or lift) so that a write of ``size`` bytes into ``directory`` succeeds."""
    if err == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
        return (f"Lift the file-size limit (ulimit -f; now {shown}) above {size} bytes, then re-run: "
                "a recipe run continues with `quark-ptq-eval resume`.")
    return (f"Free some space: at least {size} bytes on the file system holding {directory} "
            f"({_free(directory)} free now), then re-run: a recipe run continues with `quark-ptq-eval resume`.")


def _free(directory: Path) -> str:
    try:
        return f"{shutil.disk_usage(directory).free} bytes"
    except OSError:
        return "unknown"


def sweep_temporaries(directory: Path) -> list[Path]:
    """Remove the hidden temporaries ``atomic_write_bytes`` leaves when killed mid-write. Call it
    only while holding the directory's lock: a live writer's temporary must not vanish."""
    removed = []
    for tmp in [*directory.glob(".*.tmp"), *directory.glob("*/.*.tmp")]:  # next to the artifacts they replace
        if _TEMPORARY.fullmatch(tmp.name) and tmp.is_file() and not tmp.is_symlink():
            _unlink_quietly(tmp)
            removed.append(tmp)
    return removed


_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")  # mkstemp(prefix=".NAME.", suffix=".tmp")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """Read JSON, turning every expected failure into one clear sentence."""
    path = Path(path)
    try:
        # O_NONBLOCK + regular-file check: a FIFO or /dev/zero named config.json must not hang or
        # exhaust memory; the size cap bounds what a hostile file can make us read.
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"The {what} {path} is not a regular file; refusing to read it.")
            if st.st_size > MAX_JSON_BYTES:
                raise UsageError(f"The {what} {path} is {st.st_size} bytes, more than any such file should be "
                                 f"({MAX_JSON_BYTES} at most).")
            text = fh.read(MAX_JSON_BYTES + 1).decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"The {what} {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"The {what} {path} cannot be read: {exc}.") from None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"The {what} {path} is not valid JSON ({exc}).", "Fix or remove it.") from None


def _unlink_quietly(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def cache_dir() -> Path:
    """Our one cache directory: $QUARK_PTQ_EVAL_CACHE, else $XDG_CACHE_HOME/quark-ptq-eval, else ~/.cache/..."""
    if os.environ.get("QUARK_PTQ_EVAL_CACHE"):
        return Path(os.environ["QUARK_PTQ_EVAL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quark-ptq-eval"


def read_cache(path: Path) -> Any:
    """A cache file's JSON, or None where it is absent or damaged (the caller builds it again)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def fill_once(path: Path, build: Callable[[Path], Any], read: Callable[[Path], Any] = read_cache) -> Any:
    """``read(path)``, else ``build(path)`` (which writes it) under a lock beside it: two processes that miss at once
    build it once, the second waits and reads what the first wrote."""
    cached = read(path)
    if cached is None:
        with held_lock(path.with_suffix(".lock")):
            cached = read(path)
            if cached is None:
                cached = build(path)
    return cached


@contextlib.contextmanager
def held_lock(lock_file: Path) -> Iterator[None]:
    """An exclusive lock on ``lock_file`` while the block runs, for a cache several processes may fill at once
    (the first fills it, the others wait and read it); none where the cache dir is read-only."""
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_file, "w")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
