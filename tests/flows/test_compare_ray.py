"""compare --ray and sweep on a real Ray cluster (ray.cluster_utils.Cluster: a head and a second node on
this host, 1 CPU each, one cluster for this module, shut down after it: conftest.py's ``ray_cluster``).

Two runs are shared by the tests here: the Ray comparison of the same schemes as test_compare.py's local
comparison (``compared``), during which the second node is removed while its cell runs; and a sweep of
two tiny families x one scheme, one of whose cells has a planted fault the validator fails (the other family's cell,
on the same driver and cluster, evaluates: a failed cell fails only itself; each comparison's cells are independent
the same way, test_compare.py's no_such_scheme beside the others)."""

from __future__ import annotations

import hashlib
import io
import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from quark_ptq_eval.base.errors import CheckpointPending
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.state import RunState
from tests.fixtures.compare_setup import SCHEMES, compare_kwargs

pytestmark = pytest.mark.slow
RAN = ("int8", "int4_wo_32")  # the schemes with a cell (no_such_scheme fails at its plan, on the driver)


def _cell_on(root: Path, node_id: str) -> str | None:
    """The scheme whose cell's latest attempt runs its engine on ``node_id`` now."""
    from quark_ptq_eval.flows.compare.ray_cell import read_attempts

    for scheme in RAN:
        attempts = read_attempts(root / "work" / scheme)
        steps = RunState.load(root / "work" / scheme).steps
        if attempts and attempts[-1]["node_id"] == node_id and steps.get("execute", {}).get("status") == "running":
            return scheme
    return None


@pytest.fixture(scope="module")
def ray_compared(ray_cluster, compared, tiny_llama, corpus, compare_eval_text, tmp_path_factory):
    """compare --ray (Python API) of SCHEMES; the second node removed once its cell's engine runs."""
    from quark_ptq_eval import compare

    root = tmp_path_factory.mktemp("compare-ray") / "out"
    out, events, done = io.StringIO(), [], {}
    second = ray_cluster.second_id

    def drive() -> None:
        stderr, sys.stderr = sys.stderr, out  # the driver's terminal (its Reporter writes to sys.stderr)
        try:
            done["doc"] = compare(tiny_llama, SCHEMES, root, ray="auto", quiet=False,
                                  approver=FlagApprover(["intake", "plan", "execute", "result"]),
                                  progress=lambda e, s: events.append((e, s)), **compare_kwargs(corpus, compare_eval_text))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            done["error"] = exc
        finally:
            sys.stderr = stderr

    thread = threading.Thread(target=drive)
    thread.start()
    removed = None
    while thread.is_alive() and removed is None:
        removed = _cell_on(root, second)
        time.sleep(0.2)
    if removed:  # once its engine process runs
        deadline = time.monotonic() + 300
        while thread.is_alive() and time.monotonic() < deadline and not _engine_running(root / "models" / removed):
            time.sleep(0.05)
        ray_cluster.cluster.remove_node(ray_cluster.second)
    thread.join(timeout=900)
    ray_cluster.restore()
    assert "error" not in done, done.get("error")
    return {"root": root, "doc": done["doc"], "removed": removed, "second": second, "events": events,
            "terminal": out.getvalue()}


def _engine_running(output: Path) -> bool:
    """A Quark engine writing ``output`` (its staging dir) runs now (on any node: they are all this host)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "quark_api_engine" in cmd and str(output) in cmd:
            return True
    return False


def _normalised(doc: dict, root: Path) -> dict:
    """The report without what may differ between two runs: timings, nodes, paths, this run's cache counters."""
    text = json.dumps(doc).replace(str(root), "ROOT")
    doc = json.loads(text)
    doc.pop("cluster", None)
    doc.pop("created_at", None)
    for key in ("built_seconds", "writes_this_run", "hits_this_run"):
        doc["baseline_cache"].pop(key, None)
    for row in doc["schemes"]:
        row.pop("quantize_s", None)
    return doc


def _digests(model_dir: Path) -> dict[str, str]:
    # the chosen scheme's model card names its own run's paths: the weights and aux files are what must match
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())
            if p.is_file() and p.name != "README.md"}


def test_every_cell_ran_as_a_ray_task_and_the_report_names_its_node(ray_compared, ray_cluster):
    doc, cells = ray_compared["doc"], ray_compared["doc"]["cluster"]["cells"]
    assert set(cells) == set(RAN)
    head = ray_cluster.cluster.head_node.node_id
    for scheme in RAN:
        assert cells[scheme]["status"] == "evaluated" and cells[scheme]["node_id"] == head  # the lost one: retried there
        assert cells[scheme]["resources"]["num_cpus"] == 1 and cells[scheme]["resources"]["memory"] > 2**30
    report = (ray_compared["root"] / "comparison_report.md").read_text()
    assert "## Cluster" in report and all(f"| {s} | {cells[s]['node']} |" in report for s in RAN)
    terminal = ray_compared["terminal"]
    for scheme in RAN:  # one progress line per cell as it changed: queued, its node and step, the end
        assert f"[{scheme}] on 127.0.0.1 (" in terminal and f"[{scheme}] evaluated on" in terminal
    assert ("done", "int8") in ray_compared["events"] and ("failed", "no_such_scheme") in ray_compared["events"]
    assert {r["scheme"]: r["status"] for r in doc["schemes"]}["no_such_scheme"] == "failed"


def test_the_report_equals_a_local_compares_but_for_timings_and_nodes(ray_compared, compared):
    ours, local = _normalised(ray_compared["doc"], ray_compared["root"]), _normalised(compared["doc"], compared["root"])
    assert ours == local
    ray_md = (ray_compared["root"] / "comparison_report.md").read_text().split("\n## Cluster")[0]
    local_md = (compared["root"] / "comparison_report.md").read_text()
    assert _masked(ray_md, ray_compared["root"]) == _masked(local_md, compared["root"])


def _masked(markdown: str, root: Path) -> list[str]:
    """The report's lines with its root as ROOT, each scheme's engine time and this run's cache counters masked."""
    text = re.sub(r"\| [0-9.]+ (s|min) \|$", "| TIME |", markdown.replace(str(root), "ROOT"), flags=re.M)
    return re.sub(r"this run built it \d+× and read it \d+×", "COUNTS", text).rstrip().splitlines()


def test_a_cell_on_a_lost_node_completes_on_the_head_retried_with_a_clean_export(ray_compared, compared):
    scheme, root = ray_compared["removed"], ray_compared["root"]
    assert scheme in RAN, "no cell ran its engine on the second node"
    cell = ray_compared["doc"]["cluster"]["cells"][scheme]
    assert cell["retried"] and cell["attempts"] == 2 and cell["lost"][0]["why"] == "its node was lost"
    assert ray_compared["second"][:8] in cell["lost"][0]["node"]
    others = [s for s in RAN if s != scheme]
    assert not any(ray_compared["doc"]["cluster"]["cells"][s]["retried"] for s in others)
    report = (root / "comparison_report.md").read_text()
    assert f"| {scheme} |" in report and "retried: attempt 1 on" in report and "its node was lost" in report
    assert f"{scheme}: retried on" in ray_compared["terminal"]
    # one writer: the lost attempt's engine run is recorded as begun, the retry's as the only success;
    # the output is the verified export alone (the partial staging dir of the lost attempt set aside, if any)
    runs = yaml.safe_load((root / "work" / scheme / "run_manifest.yaml").read_text())["runs"]
    assert [r["status"] for r in runs][-1] == "succeeded" and sum(r["status"] == "succeeded" for r in runs) == 1
    assert not (root / "models" / f"{scheme}.partial").exists()
    assert not list((root / "models").glob(".*.lock"))  # the claim was released
    for s in RAN:  # same tensors, same bytes as the clean local run's export
        assert _digests(root / "models" / s) == _digests(compared["root"] / "models" / s)


def test_the_chaos_campaigns_checks_hold_on_the_comparison_that_lost_a_node(ray_compared, compared, monkeypatch):
    """The Ray chaos campaign's real-code trial in the suite (bench/benchmarks/ray_chaos.py, its seeded slice with the
    planted bug in tests/reliability/test_ray_chaos.py): a node lost while its cell's engine runs, at the same
    instant each time (the first engine on the second node), and the campaign's own checks against the undisturbed
    local comparison: every cell's export bytes, validation and Tier 1 figures; one engine run succeeded a cell;
    nothing written after it was validated and scored, what was validated the final export; nothing left behind
    (staging, claims, locks); the report naming the cell Ray retried and no other."""
    from bench.benchmarks import ray_chaos

    monkeypatch.setitem(ray_chaos.SCHEMES, "compare", list(RAN))
    refs = {f"compare:compare/{s}": ray_chaos.cell_result(compared["root"], s) for s in RAN}
    trial = ray_chaos.Trial(0, "compare", "worker_kill", 0.0)
    assert ray_chaos.check("compare", ray_compared["root"], refs, trial) == []
    assert trial.retries == 1 and trial.reported_retried == [f"compare/{ray_compared['removed']}"], trial


# --- sweep: two tiny families x one scheme, one cell with a planted validator fault ----------------------
@pytest.fixture(scope="module")
def swept(ray_cluster, cli, tiny_model, corpus, compare_eval_text, tmp_path_factory):
    from quark_ptq_eval.flows.sweep import sweep

    here = tmp_path_factory.mktemp("sweep")
    grid = here / "grid.yaml"
    grid.write_text(yaml.safe_dump({
        "models": {"llama": str(tiny_model("llama")), "qwen3": str(tiny_model("qwen3"))},
        "schemes": ["int8"],
        "options": {"calib_data": str(corpus), "num_calib_samples": 8, "calib_seq_len": 64,
                    "eval_data": str(compare_eval_text), "seq_len": 128, "max_windows": 4, "eval_device": "cpu",
                    "top_k": 16, "offline": True}}), encoding="utf-8")
    out = here / "out"
    with pytest.raises(CheckpointPending) as first:  # every comparison stops at its execution gate
        sweep(grid, out, approver=FlagApprover(["intake", "plan"]), ray="auto")
    manifest = out / "qwen3" / "work" / "int8" / "run_manifest.yaml"
    doc = yaml.safe_load(manifest.read_text())
    for command in (doc["command"], doc["steps"][3]):  # the planted fault: not the plan's scheme, approved as shown
        argv = command["argv"]
        argv[argv.index("--quant_scheme") + 1] = "int4_wo_128"
        command["shell" if "shell" in command else "command"] = " ".join(argv)
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    # the second call from the command line: another driver process, joining the cluster by its address
    res = cli("sweep", grid, "-o", out, "--approve", "execute,result", f"--ray={ray_cluster.cluster.address}", "--json")
    assert res.rc == 0, res.err
    return {"out": out, "summary": json.loads(res.out), "first": first.value, "err": res.err}


def test_sweep_runs_every_cell_once_and_a_planted_fault_fails_only_its_cell(swept):
    assert "2 of the sweep's 2 comparisons wait" in swept["first"].message and "--approve" in swept["first"].hint
    summary = swept["summary"]
    by = {(e["model"], r["scheme"]): r for e in summary["comparisons"] for r in e["schemes"]}
    assert set(by) == {("llama", "int8"), ("qwen3", "int8")}
    bad = by[("qwen3", "int8")]
    assert bad["status"] == "failed" and bad["failed_step"] == "validate"
    cells = {e["model"]: e["cluster"]["cells"] for e in summary["comparisons"]}
    assert cells["qwen3"]["int8"]["exit_code"] == 4 and cells["qwen3"]["int8"]["attempts"] == 1  # not retried
    for key, row in by.items():
        if key != ("qwen3", "int8"):
            assert row["status"] == "evaluated" and row["kl_mean"] is not None, key
    assert "Traceback" not in swept["err"]
    table = (swept["out"] / "sweep_summary.md").read_text()
    assert "| qwen3 | - | int8 | failed at validate:" in table and table.count("| evaluated |") == 1
    for model in ("llama", "qwen3"):
        assert (swept["out"] / model / "comparison_report.md").is_file()

