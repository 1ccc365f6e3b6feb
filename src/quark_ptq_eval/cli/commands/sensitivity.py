"""`quark-ptq-eval sensitivity MODEL --scheme S`: arguments and handler (the package's API does the work)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from quark_ptq_eval.base.errors import ExitCode, UsageError
from quark_ptq_eval.base.options import add_flags, add_offline_flag, apply_offline, given
from quark_ptq_eval.base.textdata import check_text_source
from quark_ptq_eval.base.ui import noise_to_log

if TYPE_CHECKING:
    from quark_ptq_eval.plan.targets import ArchFamily


def add_arguments(p: argparse.ArgumentParser) -> None:
    from quark_ptq_eval.plan.request import PlanRequest
    from quark_ptq_eval.sensitivity.scan import ScanOptions

    p.add_argument("model", help="local model directory")
    add_flags(p, ScanOptions, only=["scheme", "calib_data", "num_samples", "seq_len", "exclude", "expert_units"])
    p.add_argument("--max-kl", type=float, default=None,
                   help="KL budget for the proposal (default: the healthy threshold, log(1.02) ~ 0.0198)")
    p.add_argument("--wider", default="auto", metavar="SCHEME",
                   help="also measure the proposed layers at this scheme instead of unquantized, and propose it when "
                        "it meets the budget (default auto: fp8 for fp4/fp6 formats, int8 for int4; 'none': off)")
    add_flags(p, ScanOptions, only=["device"])
    add_flags(p, PlanRequest, only=["target"])  # the wider scheme only where its vLLM serves it (routed experts)
    p.add_argument("--out", type=Path, default=Path("."), help="where the sensitivity_report.* files go")
    add_flags(p, ScanOptions, only=["estimate_only", "use_cache", "trust_remote_code"])
    p.add_argument("--json", action="store_true", help="print the proposal as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true")
    add_offline_flag(p)


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.flows.recipe.plan_scan import target_rule
    from quark_ptq_eval.sensitivity import ScanOptions, run_sensitivity
    from quark_ptq_eval.sensitivity.emulation import check_scheme_runs

    apply_offline(args.offline)
    if args.max_kl is not None and not args.max_kl > 0:
        raise UsageError(f"--max-kl must be a positive number, not {args.max_kl}.")
    if not (Path(args.model) / "config.json").exists():
        raise UsageError(f"The sensitivity scan needs a local model directory; {args.model} has no config.json.")
    _check_scheme(args.scheme)
    family = _family(args.target)  # an unknown target is refused before anything loads
    if args.wider not in ("auto", "none"):
        _check_scheme(args.wider)
    check_scheme_runs(Path(args.model), args.scheme, args.exclude, None)  # before the corpus or the model
    calib = check_text_source(args.calib_data, "calibration data") if args.calib_data else _demo_corpus(args.out)
    opts = given(ScanOptions, args).build(model_dir=Path(args.model).resolve(), calib_data=Path(calib).resolve())
    say = (lambda _msg: None) if args.quiet or args.json else (lambda msg: print(msg, flush=True))
    # Quark and transformers print to stdout: keep --json parseable, and their chatter goes to the log
    with _stdout_to_stderr(args.json), noise_to_log(args.out.resolve() / "logs" / "sensitivity.log"):
        done = run_sensitivity(opts, args.out.resolve(), args.max_kl, say, None if args.wider == "none" else args.wider,
                               served=target_rule(opts.model_dir, family))
    proposal = done.proposal
    if done.status != "complete" or proposal is None:  # stopped before its end: no proposal
        return ExitCode.OK
    if args.json:
        print(json.dumps({"proposal": proposal.as_dict(), "reports": {k: str(v) for k, v in done.reports.items()},
                          "cache_hit": done.result.get("cache_hit", False)}, indent=2))
    else:
        print(proposal.reason)
        print(f"report: {done.reports['md']}")
    return ExitCode.OK


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _demo_corpus(out: Path) -> Path:
    from quark_ptq_eval.flows.demo import build_corpus

    path = out.resolve() / "sensitivity_corpus.txt"
    return path if path.exists() else build_corpus(path)


def _check_scheme(scheme: str) -> None:
    """Refuse a scheme the installed Quark does not know, before loading anything heavy."""
    from quark_ptq_eval.base.catalog import load_catalog

    schemes = load_catalog().get("schemes")
    if isinstance(schemes, (list, dict)) and schemes and scheme not in schemes:
        raise UsageError(f"Quark has no scheme named {scheme!r}; pick one of: {', '.join(sorted(schemes))}.")


def _family(target: str | None) -> ArchFamily | None:
    """The serving stack the proposal is held to: --target's, else this host's, as `plan` decides it."""
    from quark_ptq_eval.context.preflight import detect_env
    from quark_ptq_eval.plan.targets import deployment_of

    return deployment_of(target, "", detect_env()).family
