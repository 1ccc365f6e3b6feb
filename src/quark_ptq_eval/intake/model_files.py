"""Every file of a model directory that the recipe reads or copies, resolved and approved at intake.

Weights, index shards, config, tokenizer and other aux files, chat templates, custom code: one
walk over the directory, with ``lstat``/``stat`` only, so a FIFO is never opened and nothing can
hang. A symlink may resolve inside the model directory, or, for a Hugging Face cache snapshot
(``models--ORG--NAME/snapshots/REV``), inside its own ``models--*`` folder (where ``blobs/`` is).
A symlink that leads anywhere else, and any FIFO, device or socket, is refused, naming the file
and where it points. Pickled weights are then scanned for code (:mod:`.pickle_scan`).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath

from quark_ptq_eval.base.errors import UnsafeInputError
from quark_ptq_eval.intake.pickle_scan import scan_pickle

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# The Trainer's own state: pickles of settings and optimizer state that no model loader reads and
# that are never copied into the export (quark_api_engine.copy_non_weight_files skips pickles).
TRAINER_STATE = re.compile(r"(training_args\.bin|optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth)")
_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"))


def allowed_roots(model_dir: Path) -> tuple[Path, ...]:
    """Where the links of ``model_dir`` (resolved) may lead: itself, and the ``models--*`` folder
    of the Hugging Face cache snapshot it is (or lies in)."""
    for parent in model_dir.parents:
        if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
            return model_dir, parent.parent
    return (model_dir,)


def approved_target(shown: Path, roots: tuple[Path, ...]) -> Path:
    """The resolved path of directory entry ``shown``, if it may be read; else one refusal sentence."""
    if shown.is_symlink():
        try:
            target = shown.resolve(strict=True)
        except FileNotFoundError:
            raise UnsafeInputError(f"{shown} is a symlink to {os.readlink(shown)}, which does not exist.",
                                   "Restore the file or remove the link.") from None
        except (RuntimeError, OSError) as exc:  # symlink loops land here
            raise UnsafeInputError(f"{shown} cannot be resolved ({exc}).", "Fix or remove the link.") from None
        if not any(target.is_relative_to(r) for r in roots):
            raise UnsafeInputError(
                f"{shown} points outside the model directory {roots[0]} (to {target}); refusing to follow it.",
                "Copy the file into the model directory if you trust it, or remove the link.")
    else:
        target = shown.resolve()  # its parents may be approved symlinked folders
    try:
        mode = os.stat(target).st_mode
    except OSError as exc:
        raise UnsafeInputError(f"{shown} cannot be read ({exc.strerror or exc}).") from None
    for test, what in _SPECIAL:
        if test(mode):
            via = f" (through the link to {target})" if target != shown else ""
            raise UnsafeInputError(f"{shown} is {what}{via}, not a regular file; refusing to read it.",
                                   "Replace it with the real file.")
    return target


def approved_files(model_dir: Path) -> dict[str, Path]:
    """Relative POSIX path -> resolved regular file, for every file under ``model_dir``. Nothing is
    skipped, ``.git`` included: Quark's file-to-file engine copies every folder of the source."""
    root = model_dir.resolve()
    roots = allowed_roots(root)
    files: dict[str, Path] = {}
    seen_dirs = {root}
    pending = [(root, PurePosixPath())]
    while pending:
        directory, rel = pending.pop()
        try:
            with os.scandir(directory) as entries:
                names = sorted(e.name for e in entries)
        except OSError as exc:
            raise UnsafeInputError(f"{model_dir / rel} cannot be listed ({exc.strerror or exc}).") from None
        for name in names:
            shown = model_dir / rel / name
            target = approved_target(shown, roots)
            if target.is_dir():
                if target not in seen_dirs:
                    seen_dirs.add(target)
                    pending.append((target, rel / name))
            else:
                files[(rel / name).as_posix()] = target
    return files


def check_model_files(model_dir: Path) -> dict[str, Path]:
    """Approve every file of a local model before anything runs; pickled weights are scanned."""
    files = approved_files(model_dir)
    for rel, target in files.items():
        name = rel.rsplit("/", 1)[-1]
        if name.endswith(PICKLE_SUFFIXES) and not TRAINER_STATE.fullmatch(name):
            scan_pickle(target)
    return files


def copy_approved(target: Path, dst: Path) -> None:
    """Copy the approved file ``target`` to ``dst`` as a new regular file. ``O_NOFOLLOW`` keeps a link
    swapped in since intake from being followed; the rename replaces a link at ``dst``, never writes
    through it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    with open(target, "rb", opener=lambda p, _f: os.open(p, flags)) as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise UnsafeInputError(f"{target} is no longer a regular file; refusing to copy it.")
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, 1024 * 1024)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def not_regular(out: Path) -> list[str]:
    """What under an export directory is a link or a special file (an export holds regular files)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(out):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                found.append(f"{path.relative_to(out)} is a symlink to {os.readlink(path)}")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(f"{path.relative_to(out)} is not a regular file")
    return found
