"""The load check's verdict, shared by the whole-model probe (``loadcheck.py``) and the streamed one
(``load_stream.py``): which units to replay, then finite logits, the units' judgment and the greedy agreement."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quark_ptq_eval.validate.registry import CheckInputs
from quark_ptq_eval.validate.report import CheckResult, Finding

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.validate.folds import ReplayUnit
    from quark_ptq_eval.validate.load_judge import Judged
    from quark_ptq_eval.validate.replay import Capture

AGREEMENT_THRESHOLD = 0.6  # share of probe positions whose greedy next token matches the source's


def _error_limit(ctx: CheckInputs) -> tuple[float, str]:
    """(limit, why) of the module replay, set when the check starts."""
    assert ctx.shared.module_error_limit is not None
    return ctx.shared.module_error_limit


def finish_probe(ctx: CheckInputs, result: CheckResult, logits: tuple[torch.Tensor, torch.Tensor], loader: str,
                 judged: Judged, owners: int) -> None:
    """The verdict once every unit was replayed: finite logits (the export's, then the source's), then the units'
    judgment and the greedy agreement (decisive only where no unit could be replayed)."""
    got, want = logits
    if _logits_finite(got, loader, result):
        judged.report(owners, loader, result, _error_limit(ctx))
        _judge_agreement(got, want, got.shape[-2], loader, result, decisive=not (judged.loader or judged.fallback))


def replay_units(ctx: CheckInputs, owners: list[str], captures: dict[str, Capture], exported: dict[str, Any],
           result: CheckResult) -> list[ReplayUnit]:
    """What to replay: each module; under AWQ/SmoothQuant the smallest unit holding its folded scales
    (folds.py); nothing where the algorithm rotated the residual stream (only the whole model is
    equivalent: greedy agreement judges)."""
    from quark_ptq_eval.validate import replay
    from quark_ptq_eval.validate.experts import coverage, every_expert_units
    from quark_ptq_eval.validate.folds import ReplayUnit, fold_groups, fold_units
    from quark_ptq_eval.validate.rewrites import ROTATING, SCALING, algorithms

    algos = set(algorithms(ctx.qconfig, ctx.plan))
    if algos & ROTATING:
        result.notes.append(f"{', '.join(sorted(algos & ROTATING))} rotates the residual stream: no module is "
                            "equivalent to the source's alone")
        return []
    targets = replay.replay_targets(owners, captures, exported)
    if not algos & SCALING:
        forced = every_expert_units(captures, exported, _error_limit(ctx)[0])
        if forced:
            routed, total = coverage(captures)
            result.stats.update(experts=total, experts_routed_by_probe=routed)
            result.notes.append(f"{len({u.module for u in forced})} experts module(s) replayed expert by expert "
                                f"(the probe's own routing reached {routed} of {total} experts)")
        return [ReplayUnit(t) for t in targets] + forced
    units = fold_units(targets, fold_groups(ctx.qconfig), set(owners),
                       lambda name: replay.replayable(captures.get(name), exported.get(name)))
    chained = sum(1 for u in units if u.norm)
    layers = sum(1 for u in units if u.residual)
    # each linear a composite unit holds, alone too: the loader held to the emulation on the same input, where a
    # fold unit's output can hide a misread (block 0's MLP that SmoothQuant crushed outputs exactly zero)
    keys = {u.key for u in units}
    alone = [ReplayUnit(t, alone=True) for t in targets if t not in keys and replay.is_leaf(captures.get(t))]
    result.notes.append(f"{', '.join(sorted(algos & SCALING))} folds scales between modules: {chained} unit(s) "
                        f"replayed after their export's norm, {layers} decoder layer(s) replayed whole, "
                        f"{len(alone)} linear(s) inside the others also replayed alone (the loader judged)")
    return units + alone


def _logits_finite(got: torch.Tensor, loader: str, result: CheckResult) -> bool:
    import torch

    finite = torch.isfinite(got)
    if bool(finite.all()):
        return True
    bad = int((~finite).sum())
    result.findings.append(Finding("logits", f"are not finite at {bad} of {got.numel()} values on the probe.",
                                   side="quark", evidence=f"expected: finite logits; found: {bad} NaN/inf "
                                                          f"(loader {loader})"))
    return False


def _judge_agreement(got: torch.Tensor, want: torch.Tensor, positions: int, loader: str, result: CheckResult,
                     decisive: bool) -> None:
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    result.stats["greedy_agreement"] = round(agreement, 4)
    role = f"threshold {AGREEMENT_THRESHOLD:.0%}" if decisive else "informational: the module replay judges"
    result.notes.append(f"greedy next tokens agree with the source's on {agreement:.1%} of {positions} probe "
                        f"positions ({role})")
    if decisive:
        result.stats["agreement_threshold"] = AGREEMENT_THRESHOLD
    if decisive and agreement < AGREEMENT_THRESHOLD:
        result.findings.append(Finding(
            "greedy next tokens", f"agree with the source's on {agreement:.1%} of {positions} probe positions, "
            f"below the {AGREEMENT_THRESHOLD:.0%} threshold.", side="quark",
            evidence=f"expected: at least {AGREEMENT_THRESHOLD:.0%} agreement; found {agreement:.1%} (loader {loader})"))

