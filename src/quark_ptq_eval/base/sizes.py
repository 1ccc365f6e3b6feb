"""Byte sizes as the plan and reports print them (a base module: the plan's steps share it)."""

from __future__ import annotations

GIB = 2**30


def gb(n: float | None) -> str:
    """`n` bytes as GiB above one GiB, MiB below; '?' when unknown."""
    if n is None:
        return "?"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"
