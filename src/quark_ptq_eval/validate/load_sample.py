"""Which decoder blocks the streamed load check replays: every one that fits its time budget.

The streamed probe's cost is per block (read both parts, run the source, emulate, replay the loader's units): on
this 2-core host ~25 s a Llama-3-70B block and ~100 s a 405 B one, so every block of a 405 B would take hours.
What the check proves is per module kind (the loader builds each block's modules alike; the decode check has
already decoded every weight of every block against its source). So when replaying every block would overrun
``budget_s``, it replays an evenly spaced sample that fits, always the first and the last block, and says which.
The budget is measured, not guessed: the first block's time sets how many fit. A skipped block is skipped on both
sides, so each sampled block runs the source and the export on the same hidden states (the last block run's
output: a residual stream's neighbour) and the loader is judged against the emulation exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_BUDGET_S = 300.0  # five minutes: a 70 B on this host replays ~a sixth of its blocks, a 405 B three
MIN_SAMPLE = 2  # the first and the last block, whatever the budget
LOAD_MINUTES_HELP = (f"time budget of the load check streamed one block at a time (default "
                     f"{DEFAULT_BUDGET_S / 60:.0f}): beyond it an evenly spaced sample of blocks, first and last "
                     "included, is replayed and the report names them; 0 replays every block")


def load_budget_s(minutes: float | None) -> float | None:
    """``--load-check-minutes`` as the budget in seconds (None: the default; 0: every block)."""
    if minutes is None:
        return DEFAULT_BUDGET_S
    if minutes < 0:
        from quark_ptq_eval.base.errors import UsageError

        raise UsageError(f"--load-check-minutes must be 0 (every block) or more, not {minutes:g}.")
    return minutes * 60.0


@dataclass
class BlockSample:
    """The blocks to replay, decided after the first one is timed (``budget_s`` None or 0: every block)."""

    blocks: int
    budget_s: float | None = DEFAULT_BUDGET_S
    chosen: list[int] | None = None  # None until the first block's time is known
    first_s: float = 0.0
    ends_s: float = 0.0  # the entry's time, counted twice: the exit (lm_head) costs about what the entry did
    skipped: list[int] = field(default_factory=list)

    def take(self, index: int) -> bool:
        """Whether block ``index`` is replayed (blocks are asked for in order)."""
        taken = self.chosen is None or index in self.chosen
        if not taken:
            self.skipped.append(index)
        return taken

    def entry_took(self, seconds: float) -> None:
        self.ends_s = 2 * seconds

    def timed(self, index: int, seconds: float) -> None:
        """Block ``index`` took ``seconds``: after the first, the sample is fixed."""
        if self.chosen is not None:
            return
        self.first_s = seconds
        self.chosen = sample(self.blocks, self.budget_s, seconds, self.ends_s)

    @property
    def sampled(self) -> bool:
        return bool(self.skipped)

    def note(self) -> str | None:
        if not self.sampled:
            return None
        run = self.blocks - len(self.skipped)
        return (f"replayed {run} of {self.blocks} decoder blocks ({_ranges(sorted(self.chosen or []))}): every block "
                f"would take about {self.blocks * self.first_s / 60:.0f} min here (the first took "
                f"{self.first_s:.0f} s) and the check's budget is {(self.budget_s or 0) / 60:.0f} min; each skipped "
                "block is skipped on both sides and every block's weights were decoded by the decode check (every "
                "block: --load-check-minutes 0)")


def sample(blocks: int, budget_s: float | None, per_block_s: float, ends_s: float = 0.0) -> list[int]:
    """Evenly spaced block indices, first and last included, as many as ``budget_s`` holds at ``per_block_s`` after
    ``ends_s`` (the entry and exit parts)."""
    if not budget_s or per_block_s <= 0 or ends_s + blocks * per_block_s <= budget_s:
        return list(range(blocks))
    n = max(MIN_SAMPLE, min(blocks, int((budget_s - ends_s) // per_block_s)))
    if blocks == 1:
        return [0]
    return sorted({round(k * (blocks - 1) / (n - 1)) for k in range(n)})


def _ranges(indices: list[int]) -> str:
    """``0-2, 7, 9``: a sorted list of ints, runs joined."""
    parts: list[str] = []
    start = prev = None
    for i in [*indices, None]:
        if i is not None and prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = i
    return ", ".join(parts)
