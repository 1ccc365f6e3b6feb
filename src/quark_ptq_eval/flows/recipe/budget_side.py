"""The budget search's plans measured side by side, through compare's machinery.

After a `run --budget-bits` has evaluated its own export at Tier 1, the plans the search report names
(budget/groups.py ``side_plans``: the search's mix, each uniform format within the budget, the naive
mix with the first and last blocks in the widest format, the search again at the naive mix's bits) are each
quantized, validated and scored by a comparison (flows/compare) in ``<workdir>/side_by_side``: one baseline
cached once, the run's Tier 1 text, windows and calibration documents, so every plan is measured on the same
windows. Their engines run in this process (Quark is imported once, by the scans). search_report.{json,md}
then hold predicted beside measured KL for each plan, the additivity check (the prediction is the sum of
each group's KL quantized alone) and the recommendation: the measured best within the budget.

Giving --budget-bits with a Tier 1 evaluation is the user's yes to these runs, as it is to the scans.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from quark_ptq_eval.base.artifacts import QuantPlan
from quark_ptq_eval.base.errors import CheckpointPending, QpeError
from quark_ptq_eval.budget.measured import SEARCH_JSON, CellRow, Measured, read_side_plans, record_measured
from quark_ptq_eval.evaluate.options import EvalOptions
from quark_ptq_eval.evaluate.ppl.baseline_cache import DEFAULT_TOP_K
from quark_ptq_eval.flows.compare.options import PLAN, TIER1, CompareOptions, MixCell
from quark_ptq_eval.flows.recipe.recipe_flow import Flow
from quark_ptq_eval.plan.request import SEARCH_FIELDS

SIDE_DIR = "side_by_side"  # under the run's work dir: a comparison's own root
EXACT_VOCAB = 8192  # up to this vocabulary the baseline cache keeps every log-probability (8 bytes each a token)


def measure_side_by_side(flow: Flow, plan: QuantPlan) -> list[Measured]:
    """Measure the search report's side-by-side plans (none: the plan has no budget search); search_report
    gets the measurements."""
    path = flow.run.workdir / SEARCH_JSON
    row = plan.decision("budget_search")
    if row is None or not path.is_file() or flow.model_path is None:
        return []
    sides = read_side_plans(flow.run.workdir)
    if not sides:
        return []
    flow.run.ui.info(f"Budget search: measuring {len(sides)} plans side by side on the same windows "
                     f"({', '.join(s.label for s in sides)})")
    cells = {s.label: MixCell(s.scheme, dict(s.overrides)) for s in sides}
    doc = compare_cells(flow, plan, cells, flow.run.workdir / SIDE_DIR, "Budget search")
    if doc is None:
        return []
    rows = {r["scheme"]: CellRow.of(r) for r in doc.get("schemes") or []}
    return record_measured(flow.run.workdir, rows, flow.model_path, list(plan.exclude_layers)).measured


def compare_cells(flow: Flow, plan: QuantPlan, cells: dict[str, MixCell], root: Path, what: str,
                  progress: Callable[[str, str], None] | None = None) -> dict | None:
    """``cells`` quantized, validated and scored by a comparison in ``root`` on the run's Tier 1 windows, against
    one cached baseline; comparison.json's content, or None where the comparison failed (said, with ``what``).
    ``progress`` hears each cell start and end."""
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.execute.in_process import InProcessRunner
    from quark_ptq_eval.flows.compare.flow import Comparison

    comparison = Comparison(root, flow.run.approver, Reporter(quiet=True), progress)
    comparison.engine_runner = InProcessRunner()  # Quark imported once here (the scans did), not once per plan
    try:
        return comparison.run(_options(flow, plan, cells, root))
    except CheckpointPending:
        raise  # a gate of the comparison the user has not answered: the run stops there, resumable
    except QpeError as exc:  # the run's own export and evaluation stand; the report says what is missing
        flow.run.ui.info(f"{what}: the side-by-side comparison failed: {exc.message} (see {root})")
        return None


def _options(flow: Flow, plan: QuantPlan, cells: dict[str, MixCell], root: Path) -> CompareOptions:
    """The comparison of the side-by-side plans: the run's plan options (its calibration documents), Tier 1's
    text, windows and compute, each plan a cell (its global scheme, overrides and other plan options)."""
    request = flow.opts.request
    shared = {k: v for k, v in PLAN.values(request).items()
              if k in flow.opts.request_given and v is not None and k not in SEARCH_FIELDS}  # searched already
    if plan.calibration.path:
        shared["calib_data"] = plan.calibration.path  # the calibration part the run's plan used
    shared["num_calib_samples"] = plan.calibration.num_samples
    shared["calib_seq_len"] = plan.calibration.seq_len
    shared["exclude_layers"] = list(plan.exclude_layers)
    return CompareOptions(model=str(flow.model_path), schemes=list(cells), out_root=str(root),
                          plan=shared, eval=EvalOptions(**TIER1.values(flow.opts.eval)), offline=flow.ctx.offline,
                          cells=cells, overwrite=True, top_k=_top_k(Path(str(flow.model_path))))


def _top_k(model: Path) -> int:
    """The baseline log-probabilities the comparison keeps: all of a small vocabulary (its KL is then exact, as the
    run's own Tier 1 is: the cached top-K KL is a lower bound that a tiny model's wide tail loosens), else compare's
    default."""
    vocab = int(json.loads((model / "config.json").read_text(encoding="utf-8")).get("vocab_size") or 0)
    return vocab if 0 < vocab <= EXACT_VOCAB else DEFAULT_TOP_K
