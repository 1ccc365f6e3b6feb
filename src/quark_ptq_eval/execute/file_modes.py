"""The export's file modes: what the user's umask gives, as ``cp`` would make them.

transformers' and Quark's writers create the export's files 0600 (temporary files renamed into
place), so a server running as another user (a container, a shared model store) cannot read the
weights the serving check read. After the engine the export's files get ``0666 & ~umask`` and its
folders ``0777 & ~umask``; the output inspection (inspect_output.py) checks them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from quark_ptq_eval.base.fsio import current_umask, umask_mode


def _entries(root: Path) -> list[Path]:
    """The export folder and the regular files and folders in it (links are inspect_output's problem)."""
    found = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        found += [p for p in (Path(dirpath) / n for n in dirnames + filenames)
                  if not p.is_symlink() and (p.is_file() or p.is_dir())]
    return found


def apply_umask(root: Path) -> None:
    """Give the export's files and folders the modes the umask gives (a file we cannot change is left
    to the inspection to report)."""
    mask = current_umask()
    for path in _entries(root):
        with contextlib.suppress(OSError):
            os.chmod(path, umask_mode(path.is_dir(), mask))


def mode_problems(root: Path) -> list[str]:
    """Files or folders of the export whose permission bits are not what the umask gives."""
    mask, wrong = current_umask(), []
    for path in _entries(root):
        have, want = stat.S_IMODE(path.stat().st_mode), umask_mode(path.is_dir(), mask)
        if have != want:
            wrong.append(f"{path.relative_to(root) if path != root else '.'} ({have:04o})")
    if not wrong:
        return []
    more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
    return [f"mode not what the umask ({mask:04o}) gives ({umask_mode(False, mask):04o} for files, "
            f"{umask_mode(True, mask):04o} for folders): {', '.join(wrong[:3])}{more}"]
