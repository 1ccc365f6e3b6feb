"""The family x scheme matrix: every model type the installed Quark has a template for and the
installed transformers can build offline, run through the recipe for each scheme column.

Each cell is a run of the recipe itself (``pipeline.Recipe``): intake -> plan (the plan refuses
known limits up front) -> manifest -> the Quark-API engine -> validate (load and decode checks) ->
Tier 1 perplexity with baseline on a few windows, its checkpoints approved by name; then the share
of matrix parameters actually quantized against the plan's promise. The recipe is given an
in-process engine runner (``execute/in_process.py``), so ``import quark.torch`` (~20 s) is paid once
per runner, not per cell. The ``fp8_release`` column starts from the family's instance converted to
the DeepSeek FP8 block format (tests/fixtures/fp8_release.py), which the plan reads through a dequantized
BF16 staging copy.

    python -m bench.docgen.matrix [--families llama,mixtral] [--columns fp8,awq] [--out docs/families.md]

Results are merged into ``<work>/results-TAG.json`` (reruns of a subset update their rows) and
``docs/families.md`` is regenerated from them.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import math
import os
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.docgen.families_doc import write_doc
from bench.docgen.matrix_columns import COLUMNS, FP8_RELEASE_COLUMNS
from tests.fixtures.families import build_family
from tests.fixtures.fp8_release import to_fp8_release

ROOT = Path(__file__).resolve().parents[2]
NON_MATRIX = ("embed", "norm", "wte", "wpe", "rotary", "conv")
FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
SHARE_TOLERANCE = 0.005  # measured within half a point of the promise


@dataclass
class Cell:
    family: str
    column: str
    outcome: str = "failed"  # green | refused | failed
    stage: str = ""  # plan | engine | validate | evaluate | share
    cause: str = ""  # quark | transformers | ours | (for refusals) the limit's owner
    message: str = ""
    share_measured: float | None = None
    share_promised: float | None = None
    verdict: str = ""
    loader: str = ""
    ppl: float | None = None
    ppl_base: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    decode_status: str = ""  # the decode check's: pass | fail | skipped ("" when validation did not run)
    decode_checked: int | None = None  # quantized weights decoded against the source
    decode_worst: float | None = None  # the worst element's distance from its source, in quantization steps
    decode_bound: float | None = None  # the bound, in steps (round-to-nearest: 0.5 plus float slack)


def log(msg: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- shares of matrix parameters --------------------------------------------------------------
def _is_matrix(name: str, shape: tuple) -> bool:
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    if parts[-1].endswith("bias") or any(h in leaf.lower() for h in NON_MATRIX):  # the module itself, not a parent (DBRX's norm_attn_norm.attn)
        return False
    # fused expert tensors carry no ".weight" suffix (experts.gate_up_proj, DBRX's 2-D experts.mlp.w1)
    return (len(shape) == 2 and name.endswith("weight")) or (len(shape) in (2, 3) and "expert" in name)


def matrix_params(headers: dict) -> dict[str, int]:
    """Parameters of every linear / expert weight tensor by name (embeddings and norms left out)."""
    return {n: math.prod(t.shape) for n, t in headers.items() if _is_matrix(n, tuple(t.shape))}


def measured_share(src_headers: dict, out_headers: dict) -> float:
    """1 - (float matrix weights left in the export) / (matrix parameters of the source)."""
    total = sum(matrix_params(src_headers).values())
    scaled = {n.rsplit(".", 1)[0] for n in out_headers if n.endswith(("weight_scale", "weight_scale_inv"))}
    left = sum(p for n, p in matrix_params(out_headers).items()
               if out_headers[n].dtype in FLOAT_DTYPES and n.rsplit(".", 1)[0] not in scaled)
    return 1 - left / total if total else 0.0


def promised_share(src_headers: dict, excludes: list[str]) -> float:
    """The share the plan promises: every matrix weight except the modules its exclusions match."""
    params = matrix_params(src_headers)
    total = sum(params.values())
    kept = sum(p for n, p in params.items() if _excluded(n.rsplit(".", 1)[0], excludes))
    return 1 - kept / total if total else 0.0


def _excluded(module: str, patterns: list[str]) -> bool:
    """Quark's rule: an exact module name, or an fnmatch pattern."""
    return any(module == p or fnmatch.fnmatch(module, p) for p in patterns)


# -- classification of an exception by where it was raised -----------------------------------
def classify(exc: BaseException) -> str:
    """quark / transformers / ours: the innermost frame in one of those packages."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = frame.filename.replace("\\", "/")
        if "/quark_ptq_eval/" in path or "/bench/" in path:
            return "ours"
        if "/site-packages/quark/" in path:
            return "quark"
        if "/site-packages/transformers/" in path:
            return "transformers"
    return "ours"


def _brief(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:240]}"


# -- one cell: the recipe itself (pipeline.Recipe), its engine run in this process --------------
# Every gate a cell meets is approved by name, except "fix": a fix would hide a false failure, and
# "overwrite": each cell starts in a fresh folder.
CELL_GATES = ("intake", "plan", "execute", "result", "eval", "baseline")


@dataclass
class Setup:
    work: Path
    corpus: Path
    tokenizer: Path
    catalog: dict
    env: dict
    calib_samples: int
    windows: int
    runner: Any = field(default=None)  # execute.in_process.InProcessRunner, shared by every cell

    def __post_init__(self) -> None:
        from quark_ptq_eval.execute.in_process import InProcessRunner

        self.runner = self.runner or InProcessRunner()

    def env_file(self) -> Path:
        """The host's environment context, detected once for every cell (the recipe reads it as given)."""
        path = self.work / "env_context.json"
        if not path.exists():
            path.write_text(json.dumps(self.env, indent=1))
        return path


def cell_dir(setup: Setup, family: str, column: str) -> Path:
    return setup.work / "cells" / family / column


def export_dir(setup: Setup, family: str, column: str) -> Path:
    """Where a cell's quantized model is (the recipe's output folder)."""
    return cell_dir(setup, family, column) / "out"


def cell_recipe(setup: Setup, base: Path):
    """A recipe for one cell in ``base`` (work/ and out/ under it), quiet, its engine in this process."""
    from quark_ptq_eval.base.gates import FlagApprover
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.recipe.pipeline import Recipe

    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    return Recipe(base / "work", FlagApprover(CELL_GATES), Reporter(quiet=True), engine_runner=setup.runner)


def cell_options(setup: Setup, model_dir: Path, base: Path, plan: dict):
    """The run's options: ``plan`` (PlanRequest fields) on this CPU, calibrating on a few short windows,
    then Tier 1 with the source (an FP8 release as dequantized) as the baseline."""
    from quark_ptq_eval.evaluate import BASELINE_FROM_SOURCE
    from quark_ptq_eval.flows.recipe.pipeline import RunOptions

    plan = {"calib_data": str(setup.corpus), "num_calib_samples": setup.calib_samples, "calib_seq_len": 64,
            "device": "cpu", "engine": "quark-api", **plan}
    evaluation = {"eval_data": str(setup.corpus), "max_windows": setup.windows, "seq_len": 64, "device": "cpu",
                  "baseline": BASELINE_FROM_SOURCE}
    return RunOptions(model=str(model_dir), output_dir=str(base / "out"), request=plan,
                      eval={"tier": "ppl", **evaluation}, offline=True, contexts={"env_context": str(setup.env_file())})


def run_cell(setup: Setup, family: str, model_dir: Path, column: str) -> Cell:
    scheme, algorithm = COLUMNS[column]
    base = cell_dir(setup, family, column)
    recipe = cell_recipe(setup, base)
    opts = cell_options(setup, model_dir, base, {"scheme": scheme, "algorithm": algorithm or ""})
    return run_recipe(setup, Cell(family, column), recipe, opts)


def run_recipe(setup: Setup, cell: Cell, recipe, opts) -> Cell:
    """intake -> plan -> manifest -> execute -> validate (load and decode checks) -> Tier 1 with baseline
    through ``recipe``, then the share check; every failure recorded with where it was raised."""
    from quark_ptq_eval.base.errors import UsageError

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            recipe.run(opts)  # what it says is in its work dir: reports, logs/run.log, logs/engine.log
    except Exception as exc:  # noqa: BLE001 - every failure is recorded and classified
        _failed(setup, cell, recipe, exc)
        if isinstance(exc, UsageError) and cell.stage == "plan":
            _refusal(cell, exc)
        return cell
    finally:
        _timings(cell, recipe)
    _read_results(cell, recipe)
    for stage, check in (("evaluate", _finite_ppl), ("share", _share)):
        if problem := check(cell, recipe):
            cell.stage, (cell.cause, cell.message) = stage, problem
            return cell
    cell.outcome = "green"
    return cell


STAGE_OF_PART = (("plan", "plan"), ("result", "engine"), ("validation", "validate"), ("evaluation", "evaluate"))
PHASE_STAGE = {"phase1_prepare": "plan", "phase1_execute": "engine", "phase2_validate": "validate",
               "phase3_eval": "evaluate"}


def _stage(recipe) -> str:
    """The stage a run stopped in: the first whose part the recipe did not produce."""
    parts = recipe.flow.parts if recipe.flow is not None else {}
    return next((stage for part, stage in STAGE_OF_PART if part not in parts), "share")


def _failed(setup: Setup, cell: Cell, recipe, exc: BaseException) -> None:
    cell.stage = _stage(recipe)
    _read_decode(cell, recipe.workdir)
    if cell.stage == "validate" and (problem := _validation_problem(recipe.workdir)):
        cell.cause, cell.message = problem
        return
    engine_error = setup.runner.last_error if cell.stage == "engine" else None
    cell.cause = classify(engine_error or exc)
    cell.message = getattr(exc, "message", None) or _brief(exc)
    if getattr(exc, "hint", None):
        cell.message += f" {exc.hint}"
    if engine_error is not None:
        cell.message = _brief(engine_error)


def _refusal(cell: Cell, exc) -> None:
    """A plan refused up front: a known family limit, or Quark's template lacking the algorithm."""
    from quark_ptq_eval.plan.family_limits import limit_for

    scheme, algorithm = COLUMNS[cell.column]
    lim = limit_for(cell.family, scheme, algorithm)
    no_algo = "is not available for model_type" in exc.message  # Quark's template has no config for it
    cell.outcome = "refused" if lim or no_algo else "failed"
    cell.cause = lim.owner if lim else "quark" if no_algo else "ours"


def _timings(cell: Cell, recipe) -> None:
    for phase, seconds in recipe.timings.items():
        if phase in PHASE_STAGE:
            cell.seconds[PHASE_STAGE[phase]] = seconds


def _validation_problem(workdir: Path) -> tuple[str, str] | None:
    """(cause, message) of a failed validation, from its report: Quark's when every failing finding
    says so, else ours (a false failure until shown otherwise)."""
    path = workdir / "validation_report.json"
    if not path.is_file():
        return None
    checks = json.loads(path.read_text())["checks"].values()
    bad = [f for c in checks if c["status"] == "fail" for f in c["findings"] if not f["benign"]]
    if not bad:
        return None
    cause = "quark" if {f.get("side") for f in bad} == {"quark"} else "ours"
    return cause, "; ".join(f"{f['subject']}: {f['message']}"[:200] for f in bad[:3])


def _read_decode(cell: Cell, workdir: Path) -> None:
    """The decode check's worst error and its bound (steps of the scheme's quantization step)."""
    path = workdir / "validation_report.json"
    decode = json.loads(path.read_text())["checks"].get("decode") if path.is_file() else None
    if not decode:
        return
    stats = decode.get("stats") or {}
    cell.decode_status = decode["status"]
    cell.decode_checked = stats.get("checked")
    cell.decode_worst = stats.get("worst_steps")
    bound = str(stats.get("bound", "")).split(" ", 1)[0]  # "0.502 step per element (round-to-nearest)"
    cell.decode_bound = float(bound) if bound.replace(".", "", 1).isdigit() else None


def _read_results(cell: Cell, recipe) -> None:
    _read_decode(cell, recipe.workdir)
    report = recipe.flow.parts.get("evaluation")
    if report is None or report == "skipped":
        return
    cell.verdict = report.verdict
    cell.loader = str(report.details.get("loader", "")).split(" ", 1)[0]
    cell.ppl = _score(report.quantized)
    cell.ppl_base = _score(report.baseline)


def _score(scores) -> float | None:
    if not scores:
        return None
    for metrics in (scores.values() if isinstance(scores, dict) else []):
        for value in (metrics.values() if isinstance(metrics, dict) else [metrics]):
            if isinstance(value, int | float):
                return float(value)
    return None


def _finite_ppl(cell: Cell, recipe) -> tuple[str, str] | None:
    if cell.ppl is None or not math.isfinite(cell.ppl):
        return "ours", f"no finite perplexity (verdict {cell.verdict})"
    return None


def _share(cell: Cell, recipe) -> tuple[str, str] | None:
    """The share of matrix weights quantized as the plan promised."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers
    from quark_ptq_eval.plan.source_reading import effective_source

    flow = recipe.flow
    plan = flow.parts["plan"]
    source = effective_source(plan, flow.model_path)  # an FP8 release: its dequantized copy
    src, out = read_model_headers(source), read_model_headers(flow.output_dir)
    cell.share_measured = measured_share(src, out)
    cell.share_promised = promised_share(src, plan.exclude_layers)
    if cell.share_measured + SHARE_TOLERANCE < cell.share_promised:
        return "ours", (f"{cell.share_measured:.1%} of matrix parameters quantized, the plan promised "
                        f"{cell.share_promised:.1%}")
    return None


# -- the matrix -------------------------------------------------------------------------------
def families_available(catalog: dict) -> tuple[list[str], dict[str, str]]:
    """(model types to run, model type -> why it is not buildable) for Quark's templates."""
    from transformers import AutoConfig

    runnable, skipped = [], {}
    for model_type in sorted(catalog["templates"]):
        try:
            AutoConfig.for_model(model_type)
            runnable.append(model_type)
        except Exception as exc:  # noqa: BLE001
            skipped[model_type] = f"transformers {_tf_version()} has no config class for it ({type(exc).__name__})"
    return runnable, skipped


def _tf_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def prepare(work: Path, calib_samples: int, windows: int) -> Setup:
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.context.preflight import detect_env
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    corpus = work / "corpus.txt"
    if not corpus.exists():
        build_corpus(corpus)
    tok = work / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        build_tiny_model(tok, corpus, train_steps=1)  # only its tokenizer is used
    env = detect_env()
    env["hardware"] = {**env["hardware"], "accelerator": "cpu", "gpu_arch": None}
    return Setup(work, corpus, tok, load_catalog(), env, calib_samples, windows)


def build(setup: Setup, family: str) -> tuple[Path | None, str]:
    model_dir = setup.work / "models" / family
    if (model_dir / "config.json").exists():
        return model_dir, ""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            build_family(family, model_dir, setup.tokenizer)
        return model_dir, ""
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(model_dir, ignore_errors=True)
        return None, f"{classify(exc)}: {_brief(exc)}"


def build_release(setup: Setup, family: str, bf16: Path) -> tuple[Path | None, str]:
    """The family's instance as an FP8 block release (F8_E4M3 linears, 128x128 ``weight_scale_inv``)."""
    release = setup.work / "models-fp8" / family
    if (release / "config.json").exists():
        return release, ""
    try:
        return to_fp8_release(bf16, release), ""
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(release, ignore_errors=True)
        return None, f"{classify(exc)}: {_brief(exc)}"


def run_matrix(setup: Setup, families: list[str], columns: list[str], on_cell=None) -> list[Cell]:
    cells = []
    built: dict[str, tuple[Path | None, str]] = {}
    for column in columns:
        for family in families:
            t = time.monotonic()
            cell = _one_cell(setup, family, column, built)
            cell.seconds["cell"] = time.monotonic() - t
            cells.append(cell)
            stages = " ".join(f"{k}={v:.0f}" for k, v in cell.seconds.items() if k != "cell")
            decode = f" decode {cell.decode_worst}/{cell.decode_bound}" if cell.decode_status else ""
            log(f"{family:<18} {column:<11} {cell.outcome:<8} {cell.seconds['cell']:6.1f}s [{stages}]{decode} "
                f"{cell.stage} {cell.cause} {cell.message[:200]}")
            if on_cell:
                on_cell(cell)  # results survive an interrupted matrix
    return cells


def _one_cell(setup: Setup, family: str, column: str, built: dict[str, tuple[Path | None, str]]) -> Cell:
    """Build the family's instance (once; its FP8 release for an FP8-release column), then its cell."""
    from quark_ptq_eval.plan.family_limits import limit_for

    if limit_for(family, "*", None):
        return run_cell_refused(family, column)
    key = f"{family}:fp8" if column in FP8_RELEASE_COLUMNS else family
    if family not in built:
        built[family] = build(setup, family)
    if key not in built:
        built[key] = build_release(setup, family, built[family][0]) if built[family][0] else built[family]
    model_dir, why = built[key]
    if model_dir is None:
        return Cell(family, column, stage="build", cause=why.split(":", 1)[0], message=why)
    return run_cell(setup, family, model_dir, column)


def run_cell_refused(family: str, column: str) -> Cell:
    """A family the limits table refuses for every scheme: the plan's refusal, without building it."""
    from quark_ptq_eval.plan.family_limits import limit_for

    scheme, algorithm = COLUMNS[column]
    lim = limit_for(family, scheme, algorithm)
    return Cell(family, column, outcome="refused", stage="plan", cause=lim.owner,
                message=f"{lim.reason}. Instead: {lim.alternative}.")


def merge_results(path: Path, cells: list[Cell], meta: dict | None) -> dict:
    data = json.loads(path.read_text()) if path.exists() else {"cells": {}, "runs": []}
    for c in cells:
        data["cells"][f"{c.family}/{c.column}"] = asdict(c)
    if meta:
        data["runs"].append(meta)
    path.write_text(json.dumps(data, indent=1))
    return data


def all_results(work: Path) -> dict:
    """Every runner's results merged, cells by (family, column), runs in order."""
    data: dict = {"cells": {}, "runs": []}
    for path in sorted(work.glob("results-*.json")):
        part = json.loads(path.read_text())
        data["cells"].update(part["cells"])
        data["runs"] += part["runs"] or [_interrupted_run(path, part["cells"])]
    data["runs"].sort(key=lambda r: r["when"])
    return data


def _interrupted_run(path: Path, cells: dict) -> dict:
    """A runner stopped before its summary: its cells and their summed time, dated by its file."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
    cell_s = sum(c["seconds"].get("cell", 0.0) for c in cells.values())
    return {"when": when, "cells": len(cells), "cell_s": round(cell_s, 1), "interrupted": True,
            "tag": path.stem.removeprefix("results-")}


def offline_workdir(path: str) -> Path:
    """Offline for this process and every child (no Hub), and the work folder made; also bench/docgen/plan_matrix.py."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    work = Path(path)
    work.mkdir(parents=True, exist_ok=True)
    return work


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", help="comma-separated model types (default: every buildable one)")
    p.add_argument("--columns", default=",".join(COLUMNS), help=f"of {', '.join(COLUMNS)}")
    p.add_argument("--work", default=str(ROOT / ".matrix"))
    p.add_argument("--out", default=str(ROOT / "docs" / "families.md"))
    p.add_argument("--calib-samples", type=int, default=4)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--tag", default="main", help="results file results-TAG.json (parallel runners use distinct tags)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the families' tiny models first")
    p.add_argument("--doc-only", action="store_true", help="only regenerate the doc from the results in --work")
    args = p.parse_args(argv)
    work = offline_workdir(args.work)
    if args.doc_only:
        setup = prepare(work, args.calib_samples, args.windows)
        write_doc(Path(args.out), all_results(work), families_available(setup.catalog)[1], setup)
        return 0
    t0 = time.monotonic()
    import quark.torch  # noqa: F401 - paid once for the whole matrix
    import_s = time.monotonic() - t0
    log(f"import quark.torch: {import_s:.1f}s")
    setup = prepare(work, args.calib_samples, args.windows)
    runnable, skipped = families_available(setup.catalog)
    families = args.families.split(",") if args.families else runnable
    if args.rebuild:
        for family in families:
            shutil.rmtree(work / "models" / family, ignore_errors=True)
    columns = args.columns.split(",")
    t1 = time.monotonic()
    results = work / f"results-{args.tag}.json"
    cells = run_matrix(setup, families, columns, lambda c: merge_results(results, [c], None))
    wall = time.monotonic() - t0
    per_cell = (time.monotonic() - t1) / max(len(cells), 1)
    log(f"{len(cells)} cells in {wall:.0f}s wall ({per_cell:.1f}s per cell, quark import {import_s:.0f}s once)")
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "families": len(families),
            "columns": columns, "cells": len(cells), "wall_s": round(wall, 1), "per_cell_s": round(per_cell, 1),
            "import_s": round(import_s, 1)}
    merge_results(results, cells, meta)
    write_doc(Path(args.out), all_results(work), skipped, setup)
    return 0 if all(c.outcome != "failed" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
