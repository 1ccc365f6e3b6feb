"""What the budget search is asked: a bits budget, a size budget (the export on disk) or an accuracy floor.

- ``--budget-bits B``: effective bits over the quantizable linears (budget/knapsack.py);
- ``--budget-size SIZE``: the export's safetensors on disk; turned into effective bits by taking off what the
  export keeps as it is (the tensors of everything but the quantized linears, in the source's width);
- an accuracy floor, ``--max-kl K`` or ``--max-ppl-increase-pct P`` (or, with ``--formats``, a goal such as
  "within 1 % perplexity"): the fewest bits whose predicted KL stays within it. A perplexity increase of P %
  is a mean KL of log(1 + P/100) (KL is the mean extra NLL against the source's own predictions: the same
  conversion as the sensitivity scan's default budget, log(1.02) for the 2 % healthy threshold).

The default ``--formats`` is the target's (plan/targets.py ``ArchFamily.mix``), those the installed Quark knows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.plan.request import PlanRequest

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
SIZE = re.compile(r"^\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<u>[a-z]*)\s*$")
# "within 1 % perplexity", "at most 0.5% ppl increase", "under 2 % of perplexity"
GOAL_PPL = re.compile(r"(?:within|at most|under|below|less than|no more than)\s+(?P<p>\d+(?:\.\d+)?)\s*"
                      r"(?:%|percent)\s*(?:of\s+)?(?:the\s+)?(?:perplexity|ppl)")


@dataclass(frozen=True)
class BudgetAsk:
    """One of: ``bits``, ``size_bytes`` (turned into bits once the model's tensors are read), ``max_kl``."""

    bits: float | None = None
    size_bytes: int | None = None
    max_kl: float | None = None
    given: str = ""  # how the user said it, for the plan's reason and the errors

    @property
    def is_floor(self) -> bool:
        return self.bits is None and self.size_bytes is None


def parse_size(text: str) -> int:
    """Bytes of "4.5GB", "800MiB", "123456" (GB = 10^9, GiB = 2^30)."""
    m = SIZE.match(text.lower())
    if not m or m["u"] not in UNITS:
        raise UsageError(f"--budget-size {text!r} is not a size.", "Write it as a number and a unit, e.g. 4.5GB or "
                                                                   "800MiB (GB = 10^9 bytes, GiB = 2^30).")
    return int(float(m["n"]) * UNITS[m["u"]])


def goal_ppl_pct(goal: str) -> float | None:
    """The perplexity increase a goal allows ("within 1 % perplexity" -> 1.0), or None."""
    m = GOAL_PPL.search(goal.lower())
    return float(m["p"]) if m else None


def budget_ask(req: PlanRequest) -> BudgetAsk | None:
    """The budget the request asks the search for (None: no search). At most one kind may be given."""
    pct = req.max_ppl_increase_pct
    if pct is None and req.formats and not req.sensitivity:
        pct = goal_ppl_pct(req.goal)
    floor_kl = req.max_kl if not req.sensitivity else None
    asks = [a for a in (
        BudgetAsk(bits=req.budget_bits, given=f"--budget-bits {req.budget_bits:g}") if req.budget_bits is not None else None,
        BudgetAsk(size_bytes=parse_size(req.budget_size), given=f"--budget-size {req.budget_size}")
        if req.budget_size else None,
        BudgetAsk(max_kl=floor_kl, given=f"--max-kl {floor_kl:g}") if floor_kl is not None else None,
        BudgetAsk(max_kl=math.log1p(pct / 100), given=f"a perplexity increase of at most {pct:g} %")
        if pct is not None else None,
    ) if a is not None]
    if len(asks) > 1:
        raise UsageError(f"The budget search takes one budget; got {' and '.join(a.given for a in asks)}.",
                         "Keep one of --budget-bits, --budget-size, --max-kl, --max-ppl-increase-pct.")
    if asks and (asks[0].max_kl is not None and not asks[0].max_kl > 0):
        raise UsageError(f"The accuracy floor must be positive; got {asks[0].given}.")
    return asks[0] if asks else None


def default_formats(arch: str | None, known: list[str]) -> list[str]:
    """The target's formats to mix, those this Quark knows (plan/targets.py ``ArchFamily.mix``)."""
    from quark_ptq_eval.plan.targets import FAMILIES

    family = FAMILIES.get(arch or "")
    return [f for f in (family.mix if family else ()) if f in known]
