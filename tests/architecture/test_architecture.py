"""The architecture's promises: one step table, one gatekeeper, registries that every list of
names is derived from, no import cycle and short functions. Cheap: nothing here runs Quark."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from quark_ptq_eval.base import contracts
from quark_ptq_eval.base.errors import CheckpointPending, UsageError
from quark_ptq_eval.base.gates import FlagApprover, Gatekeeper
from quark_ptq_eval.base.plan_records import PlannedCalibration
from quark_ptq_eval.base.state import RunState
from quark_ptq_eval.base.step_table import STEP_NAMES, STEPS
from quark_ptq_eval.evaluate.tiers import TIERS, tier_checkpoint
from quark_ptq_eval.flows.recipe.status import describe_status
from quark_ptq_eval.plan.engines import ENGINE_NAMES, choose_engine, get_engine

SRC = Path(__file__).resolve().parents[2] / "src" / "quark_ptq_eval"


# The layers, lowest first: a module imports its own package, the base and the packages before
# its own. The command line (cli/) stands on top: nothing imports it but the package's entry points
# (quark_ptq_eval/__init__.py, __main__.py), which stand above the layers. runtime (running a model: the block
# streamer, the vLLM server) stands below execute: the sequential engine runs Quark on the block streamer's parts.
LAYERS = ("base", "context", "intake", "plan", "manifest", "runtime", "execute", "validate", "evaluate", "sensitivity",
          "budget", "publish", "flows", "cli")


def _import_statements(root: Path = SRC) -> list[tuple[str, str, str]]:
    """(importing module, "path:line", imported module) for every import statement between the
    modules under ``root`` (a package), wherever it stands (TYPE_CHECKING, functions)."""
    files = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    found = []
    for mod, f in sorted(files.items()):
        pkg = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            where = f"{f.relative_to(root.parent)}:{node.lineno}"
            found += [(mod, where, t) for t in targets if t in files and t != mod]
    return found


def _module_graph(root: Path = SRC) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, _, target in _import_statements(root):
        graph.setdefault(mod, set()).add(target)
        graph.setdefault(target, set())
    return graph


def _layer(module: str) -> str | None:
    """The layer (first package under quark_ptq_eval) of a module; None for the entry points above them."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def _against_layers(statements: list[tuple[str, str, str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    wrong = []
    for mod, where, target in statements:
        own, other = _layer(mod), _layer(target)
        if own is None or own == other:
            continue
        if own not in rank:
            wrong.append(f"{where}: {mod} is in no layer of {LAYERS}")
        elif rank.get(other or "flows", len(LAYERS)) > rank[own]:  # the package itself (its __version__, its API) is for the flows
            wrong.append(f"{where}: {mod} imports {target}, but {own} may import only {LAYERS[:rank[own] + 1]}")
    return wrong


def _package_cycle(statements: list[tuple[str, str, str]]) -> list[str]:
    """One cycle between packages (layers), each step shown with an import statement that makes it."""
    edges: dict[tuple[str, str], str] = {}
    for mod, where, target in statements:
        own, other = _layer(mod), _layer(target)
        if own and other and own != other:
            edges.setdefault((own, other), f"{where}: {mod} imports {target}")
    graph: dict[str, set[str]] = {}
    for own, other in edges:
        graph.setdefault(own, set()).add(other)
        graph.setdefault(other, set())
    cycle = _cycle(graph) or []
    return [edges[(a, b)] for a, b in zip(cycle, cycle[1:], strict=False)]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_not_even_under_type_checking():
    graph = _module_graph()
    assert "quark_ptq_eval.plan.engines" in graph and graph["quark_ptq_eval.manifest.build"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_import_cycle_in_the_benchmarks():
    """bench/ too: the matrix runner and the page it writes share its columns through bench/docgen/matrix_columns.py."""
    graph = _module_graph(SRC.parents[1] / "bench")
    assert "bench.docgen.families_doc" in graph["bench.docgen.matrix"] and "tests.fixtures.families" not in graph  # bench/ alone
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_every_import_follows_the_layer_order():
    statements = _import_statements()
    assert {_layer(m) for m, _, _ in statements} >= set(LAYERS)  # every layer was read
    # the rule itself: a step importing a flow, the base importing a step and a flow importing the command
    # line are refused; the command line importing a flow, and the entry point the command line, are not
    planted = [("quark_ptq_eval.plan.x", "plan/x.py:1", "quark_ptq_eval.flows.api"),
               ("quark_ptq_eval.base.y", "base/y.py:2", "quark_ptq_eval.context.preflight"),
               ("quark_ptq_eval.flows.z", "flows/z.py:3", "quark_ptq_eval.cli.main"),
               ("quark_ptq_eval.cli.commands.run", "cli/commands/run.py:4", "quark_ptq_eval.flows.recipe.pipeline"),
               ("quark_ptq_eval.__main__", "__main__.py:5", "quark_ptq_eval.cli.main"),
               # the budget search goes one way: flows -> budget -> sensitivity / plan -> base, never back up
               ("quark_ptq_eval.budget.w", "budget/w.py:6", "quark_ptq_eval.flows.recipe.plan_scan"),
               ("quark_ptq_eval.sensitivity.v", "sensitivity/v.py:7", "quark_ptq_eval.budget.search"),
               ("quark_ptq_eval.flows.recipe.u", "flows/recipe/u.py:8", "quark_ptq_eval.budget.search"),
               ("quark_ptq_eval.budget.t", "budget/t.py:9", "quark_ptq_eval.sensitivity.scan")]
    assert [w.split(":")[0] for w in _against_layers(planted)] == ["plan/x.py", "base/y.py", "flows/z.py",
                                                                    "budget/w.py", "sensitivity/v.py"]
    wrong = _against_layers(statements)
    assert wrong == [], "imports against the layer order:\n" + "\n".join(wrong)


def test_no_import_cycle_between_packages():
    statements = _import_statements()
    planted = [("quark_ptq_eval.plan.x", "plan/x.py:1", "quark_ptq_eval.execute.y"),
               ("quark_ptq_eval.execute.y", "execute/y.py:1", "quark_ptq_eval.plan.z")]
    assert len(_package_cycle(planted)) == 2  # the rule itself: plan -> execute -> plan is a cycle
    cycle = _package_cycle(statements)
    assert cycle == [], "a cycle between packages:\n" + "\n".join(cycle)


def test_no_function_over_60_lines():
    long = []
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{f.relative_to(SRC)}:{node.lineno} {node.name}")
    assert long == []


MAX_FILE_LINES = 400


def _long_files(root: Path = SRC, limit: int = MAX_FILE_LINES) -> list[str]:
    """The .py files under ``root`` longer than ``limit`` lines, each with its length."""
    found = []
    for f in sorted(root.rglob("*.py")):
        if (n := len(f.read_text(encoding="utf-8").splitlines())) > limit:
            found.append(f"{f.relative_to(root)} ({n} lines)")
    return found


def test_no_src_file_over_400_lines():
    long = _long_files()
    assert long == [], "split these into cohesive modules (one concern each):\n" + "\n".join(long)


def test_the_file_length_rule_fails_on_a_planted_long_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * MAX_FILE_LINES, encoding="utf-8")
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1), encoding="utf-8")
    assert _long_files(tmp_path) == [f"pkg/long.py ({MAX_FILE_LINES + 1} lines)"]


def _parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters as a caller sees them: every named one, *args and **kwargs one each; self/cls not."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_takes_more_than_7_parameters():
    wide = []
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _parameter_count(node) > 7:
                wide.append(f"{f.relative_to(SRC)}:{node.lineno} {node.name} ({_parameter_count(node)})")
    assert wide == [], "group the parameters of a concern into a dataclass"
    sample = ast.parse("def f(self, a, b, *c, d, e=1, **f): pass\ndef g(a, b, c, d, e, f, g, h): pass").body
    assert [_parameter_count(n) for n in sample] == [6, 8]


def test_compare_takes_its_options_from_the_per_concern_dataclasses():
    import argparse
    import dataclasses

    from quark_ptq_eval.base.options import flag_dest, flagged_fields
    from quark_ptq_eval.cli.main import build_parser
    from quark_ptq_eval.evaluate.options import EvalOptions
    from quark_ptq_eval.flows.compare import compare
    from quark_ptq_eval.flows.compare import options as copts
    from quark_ptq_eval.plan.request import CHOICE, PlanRequest

    parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["compare"]
    dests = {a.dest for a in parser._actions}
    assert copts.keywords() <= dests  # the Python API's keywords are the command's flags
    plan = {flag_dest(f, spec) for f, spec in flagged_fields(PlanRequest) if f.metadata.get("concern") != CHOICE}
    assert plan <= copts.keywords() and not {"scheme", "sensitivity"} & dests
    tier = {flag_dest(f, spec) for f, spec in flagged_fields(EvalOptions) if f.metadata.get("concern")}
    assert tier <= copts.keywords() and {"eval_batch_size", "eval_device", "tasks"} <= tier
    assert not {"eval_tier", "baseline", "vllm_port"} & dests  # compare decides its tiers and its baseline
    # no EvalOptions field declared again on CompareOptions: it holds an EvalOptions
    assert not {f.name for f in dataclasses.fields(copts.CompareOptions)} & {f.name for f in dataclasses.fields(EvalOptions)}
    opts = copts.options_from("m", "int8, fp8", "out", {"batch_size": 4, "eval_batch_size": 2, "eval_device": "cpu",
                                                        "tasks": "arc_easy,gsm8k", "max_kl": 0.1, "seq_len": 64})
    assert (opts.schemes, opts.plan, opts.max_kl) == (["int8", "fp8"], {"batch_size": 4}, 0.1)
    assert (opts.eval.batch_size, opts.eval.device, opts.eval.tasks, opts.eval.seq_len) == (2, "cpu", ["arc_easy", "gsm8k"], 64)
    assert copts.CompareOptions(**opts.to_state()).eval == opts.eval  # the state file round-trips
    with pytest.raises(TypeError, match="unexpected keyword argument.*schem"):
        compare("m", ["int8"], "out", schem="fp8")


def test_each_option_is_declared_once_on_its_dataclass_and_feeds_parser_and_api():
    import argparse
    import dataclasses

    from quark_ptq_eval import run
    from quark_ptq_eval.base.options import flag_dest, flagged_fields, given
    from quark_ptq_eval.cli.main import build_parser
    from quark_ptq_eval.evaluate.cli import eval_options_from_args
    from quark_ptq_eval.evaluate.options import EvalOptions, Thresholds
    from quark_ptq_eval.plan.request import PlanRequest

    run_parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    dests = {a.dest for a in run_parser._actions}
    for cls in (PlanRequest, EvalOptions, Thresholds):
        for field, spec in flagged_fields(cls):
            assert flag_dest(field, spec) in dests, (cls.__name__, field.name)
    # every plan field but `offline` (a run-control flag for every step) and `hold_out_eval` (set by
    # `run` from its own evaluation options, never by the user) is declared with its flag
    assert {f.name for f in dataclasses.fields(PlanRequest)} - {f.name for f, _ in flagged_fields(PlanRequest)} \
        == {"offline", "hold_out_eval"}
    args = run_parser.parse_args(["m", "--scheme", "fp8", "--layer-quant-scheme", "*down_proj", "int8",
                                  "--tasks", "arc_easy, gsm8k", "--hurt-pct", "7", "--eval-batch-size", "2"])
    plan = given(PlanRequest, args)
    assert plan.values == {"scheme": "fp8", "layer_quant_config": {"*down_proj": "int8"}}
    assert (plan.names, plan.build().scheme, plan.build().num_calib_samples) == (("scheme", "layer_quant_config"), "fp8", None)
    opts = eval_options_from_args(args)
    assert opts.tasks == ["arc_easy", "gsm8k"] and opts.batch_size == 2
    assert (opts.thresholds.healthy_pct, opts.thresholds.hurt_pct) == (2.0, 7.0)
    with pytest.raises(UsageError, match="Unknown plan option.*schem\\b"):
        run("m", "out", schem="fp8")


def test_the_step_table_drives_status_and_the_manifest_step_list(tmp_path):
    from quark_ptq_eval.manifest.build import manifest_steps

    (tmp_path / "run_state.json").write_text(json.dumps({"options": {"model": "m"}, "steps": {}}))
    listed = [line.split()[0] for line in describe_status(tmp_path)["text"].splitlines()[3:3 + len(STEPS)]]
    assert listed == list(STEP_NAMES)
    names = [s["name"] for s in manifest_steps(tmp_path, [], {"name": "run"})]
    assert names == [s.manifest_step for s in STEPS if s.manifest_step] + ["summarize"]


class Counting:
    """An approver that says ``answer`` and counts how often it was asked."""

    interactive = False

    def __init__(self, answer: bool):
        self.answer, self.asked = answer, []

    def __call__(self, gate, summary):
        self.asked.append(gate.name)
        return self.answer


def test_gatekeeper_binds_each_approval_to_content_and_records_how_to_continue(tmp_path):
    state = RunState(tmp_path)
    keeper = Gatekeeper(Counting(False), state, lambda flags: f"quark-ptq-eval resume --workdir W {flags}")
    with pytest.raises(CheckpointPending) as stop:
        keeper.require("execute", {"argv": ["a"]}, "the command")
    assert "--approve execute" in stop.value.hint
    saved = RunState.load(tmp_path)
    assert saved.waiting_for == "execute"
    assert saved.pending["continue"] == "quark-ptq-eval resume --workdir W --approve execute"
    assert "continue with: quark-ptq-eval resume --workdir W --approve execute" in describe_status(tmp_path)["text"]

    yes = Counting(True)
    keeper = Gatekeeper(yes, state, lambda flags: flags)
    keeper.require("execute", {"argv": ["a"]}, "the command")
    keeper.require("execute", {"argv": ["a"]}, "the command")  # same content: not asked again
    assert yes.asked == ["execute"] and RunState.load(tmp_path).waiting_for is None
    keeper.require("execute", {"argv": ["b"]}, "another command")  # changed content: asked again
    assert yes.asked == ["execute", "execute"]
    # an opt-in refused does not stop the run; accepted, it is recorded
    assert Gatekeeper(Counting(False), state).opt_in("baseline", {"tier": "ppl"}, "why") is False
    assert keeper.opt_in("baseline", {"tier": "ppl"}, "why") is True and "baseline" in RunState.load(tmp_path).approvals
    with pytest.raises(CheckpointPending, match="evaluation checkpoint"):
        Gatekeeper(FlagApprover(), state, lambda flags: flags).choose("eval", "Which?", tuple(TIERS),
                                                                      *tier_checkpoint())
    assert RunState.load(tmp_path).pending["continue"] == f"--eval-tier {'|'.join(TIERS)}"


def test_engine_names_come_from_the_registry_everywhere():
    from quark_ptq_eval.cli.main import build_parser

    schema = contracts.own_schema("quant_plan")
    assert schema["properties"]["engine"]["properties"]["name"]["enum"] == list(ENGINE_NAMES)
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    engine_flag = next(a for a in run._actions if "--engine" in a.option_strings)
    assert list(engine_flag.choices) == ["auto", *ENGINE_NAMES]
    for name in ENGINE_NAMES:
        assert get_engine(name).name == name
    with pytest.raises(UsageError, match="Unknown engine"):
        get_engine("quark-onnx")
    local = PlannedCalibration("local_file", None, "calibration.txt", 16, 128, 1)
    assert choose_engine("auto", "cpu", local, True)[0] == "quark-api"
    assert choose_engine("auto", "amd-rocm", local, False) == (
        "quark-cli", "quark-cli with your text served from a private offline datasets cache")
    assert choose_engine("quark-cli", "cpu", local, True) == ("quark-cli", "asked for explicitly")


def test_tier_names_come_from_the_registry_everywhere():
    from quark_ptq_eval.cli.main import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    tier_flag = next(a for a in run._actions if "--eval-tier" in a.option_strings)
    assert list(tier_flag.choices) == list(TIERS)
    message, flag = tier_checkpoint()
    assert all(name in message for name in TIERS) and flag == f"--eval-tier {'|'.join(TIERS)}"


def test_library_noise_goes_to_the_log_and_progress_shows_as_milestones(tmp_path):
    import io
    import logging
    import sys

    from quark_ptq_eval.base.ui import Reporter, noise_to_log
    from quark_ptq_eval.execute.runner import EngineEcho

    log = tmp_path / "logs" / "run.log"
    real = io.StringIO()
    saved, sys.stderr = sys.stderr, real
    early = logging.StreamHandler()  # a library imported before the run holds the real stream
    logging.getLogger("qpe_test_library").addHandler(early)
    try:
        with noise_to_log(log):
            # a Quark record: colour code, then a multi-line message, then the reset
            early.stream.write("\x1b[32m\n[QUARK-INFO]: Quantizing with the configuration\n\nmore\x1b[0m\n")
            sys.stderr.write("\rLoading weights:  50%|█████     | 1/2 [00:00<00:00]")
            sys.stderr.flush()
            sys.stderr.write("\rLoading weights: 100%|██████████| 2/2 [00:00<00:00]")
            sys.stderr.flush()
            sys.stderr.write("\n")  # tqdm's close: the bar's own newline
            print("Token indices sequence length is longer than the specified maximum", file=sys.stderr)
            print("our own line", file=sys.stderr)
    finally:
        sys.stderr = saved
        logging.getLogger("qpe_test_library").removeHandler(early)
    assert real.getvalue() == "our own line\n" and early.stream is real  # handed back after the run
    # A handler a library creates during one block (transformers' own, on first use) is caught by the next.
    sys.stderr = real
    lib = logging.getLogger("qpe_test_library_late")
    try:
        with noise_to_log(tmp_path / "first.log"):
            lib.addHandler(logging.StreamHandler())
        with noise_to_log(tmp_path / "second.log"):
            lib.warning("Token indices sequence length is longer than the specified maximum")
    finally:
        sys.stderr = saved
        lib.handlers.clear()
    assert real.getvalue() == "our own line\n" and "Token indices" in (tmp_path / "second.log").read_text()
    kept = log.read_text()
    assert "[QUARK-INFO]" in kept and "more" in kept and "Loading weights" in kept and "Token indices" in kept

    out = io.StringIO()  # not a terminal: milestone lines instead of a live bar
    echo = EngineEcho(Reporter(stream=out))
    for done in range(1, 9):
        echo.write(f"Calibrating activations: {done * 100 // 8}%|███| {done}/8 [00:01<00:01,  3.2it/s]\n")
    echo.write("[QUARK-INFO]: Exporting hf_format\n")
    echo.write("Loading weights: 100%|██████████| 12/12 [00:00<00:00]\n")
    echo.write("[quark-ptq-eval] calibration: 8 samples x 64 tokens\n")
    echo.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[1].split()[0] for ln in lines[:-1]] == ["25%", "50%", "75%", "100%"], lines
    assert lines[-1] == "[quark-ptq-eval] calibration: 8 samples x 64 tokens"
