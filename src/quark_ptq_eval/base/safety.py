"""Refuse output targets that would destroy data, before anything is created."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from quark_ptq_eval.base.errors import UsageError


def _first_existing(path: Path) -> Path:
    for p in [path, *path.parents]:
        if p.exists():
            return p
    return Path("/")


def check_output_target(output: Path, model_dir: Path | None, workdir: Path) -> Path:
    """The absolute output path, or a one-sentence refusal naming what it would destroy."""
    out = Path(os.path.abspath(output.expanduser()))
    anchor = _first_existing(out)
    real = anchor.resolve() / out.relative_to(anchor)  # symlinks in the existing part resolved
    home = Path.home().resolve()
    if real == Path("/") or real == home:
        raise UsageError(f"Refusing to use {out} as the output directory: it is {'/' if real == Path('/') else 'your home directory'}.",
                         "Choose a new, dedicated directory.")
    if model_dir is not None:
        src = model_dir.resolve()
        if real == src or real.is_relative_to(src):
            raise UsageError(f"Refusing to write the quantized model into the source model directory {src}.",
                             "Choose an output directory outside it.")
        if src.is_relative_to(real):
            raise UsageError(f"Refusing to use {out} as the output directory: it contains the source model {src}.",
                             "Choose a new, dedicated directory.")
    wd = workdir.resolve()
    if real == wd or wd.is_relative_to(real):
        raise UsageError(f"Refusing to use {out} as the output directory: it is (or contains) the work directory {wd}.",
                         "Choose an output directory outside the work directory's path.")
    if out.exists() and not out.is_dir():
        raise UsageError(f"The output path {out} is a file, not a directory.", "Choose a directory path.")
    anchor = _first_existing(out.parent)
    if not anchor.is_dir():
        raise UsageError(f"Cannot create the output directory {out}: {anchor} is a file.", "Choose a directory path.")
    if not writable(anchor):
        raise UsageError(f"Cannot create the output directory {out}: {anchor} is {_why_not(anchor)}.",
                         "Choose a location you can write to, or make it writable, then re-run.")
    return out


def check_workdir(workdir: Path) -> None:
    """A work dir (or the folder it would be made in) that cannot be written is refused before
    anything is read or run: every step records its artifact there."""
    anchor = _first_existing(workdir)
    if anchor.is_dir() and not writable(anchor):
        which = "it" if anchor == workdir else f"{anchor}, where it would be created,"
        raise UsageError(f"Cannot use the work directory {workdir}: {which} is {_why_not(anchor)}.",
                         "Choose another --workdir, or make it writable, then re-run.")


def writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK) and not os.statvfs(directory).f_flag & os.ST_RDONLY


def _why_not(directory: Path) -> str:
    return "on a read-only file system" if os.statvfs(directory).f_flag & os.ST_RDONLY else "not writable"


def is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def check_free_space(target: Path, needed_bytes: int) -> None:
    anchor = _first_existing(target)
    free = shutil.disk_usage(anchor).free
    if needed_bytes > free:
        raise UsageError(
            f"Not enough disk space for the output at {target}: about {needed_bytes / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free.", "Free some space or choose another -o.")
