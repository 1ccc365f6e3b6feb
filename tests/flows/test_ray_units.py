"""The Ray side's parts that need no cluster: ray imported only when asked for, a cell's resources from
its plan, a cell no node holds refused up front, the sweep grid's errors (fast: no model, no ray)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.plan_records import DeviceStrategy


def test_the_cli_imports_no_ray_until_asked():
    code = ("import sys, quark_ptq_eval.cli.main as c; a = c.build_parser().parse_args(['compare', '--ray', '-o', 'x']);"
            "c.build_parser().parse_args(['sweep', 'g.yaml', '--ray=local', '-o', 'y']);"
            "import quark_ptq_eval.flows.compare.on_ray, quark_ptq_eval.flows.sweep; print(a.ray, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["auto", "False"]


def _plan(device: DeviceStrategy, quantize: int, evaluate: int):
    return SimpleNamespace(device_strategy=device, resources={"quantize": {"host_peak_bytes": quantize},
                                                              "evaluate": {"host_peak_bytes": evaluate}})


def test_a_cells_resources_come_from_its_plan():
    from quark_ptq_eval.flows.compare.ray_cluster import demand_of

    cpu = demand_of(_plan(DeviceStrategy("cpu", False), 3 * 2**30, 2 * 2**30))
    assert (cpu.num_cpus, cpu.num_gpus, cpu.memory) == (1.0, 0.0, 3 * 2**30)
    one = demand_of(_plan(DeviceStrategy("cuda", False, 8), 2**30, 5 * 2**30))
    assert (one.num_gpus, one.memory) == (1.0, 5 * 2**30)
    every = demand_of(_plan(DeviceStrategy("cuda", True, 8), 2**30, 2**30))
    assert every.num_gpus == 8.0 and "8 GPU" in every.text()


def test_a_cell_no_node_holds_is_refused_naming_the_largest_node():
    from quark_ptq_eval.flows.compare.ray_cluster import Demand, Node, check_fits

    nodes = [Node("a" * 40, "10.0.0.1", {"CPU": 64, "GPU": 8, "memory": 512 * 2**30}),
             Node("b" * 40, "10.0.0.2", {"CPU": 16, "memory": 64 * 2**30})]
    check_fits({"fp8": Demand(num_gpus=8, memory=100 * 2**30)}, nodes)
    with pytest.raises(UsageError) as exc:
        check_fits({"fp8": Demand(num_gpus=16, memory=2**30, basis=["engine host peak 1.0 GiB"])}, nodes)
    assert "fp8 cell asks for 1 CPU, 16 GPU" in exc.value.message and "10.0.0.1 (aaaaaaaa)" in exc.value.message


def test_the_sweep_grid_is_checked_before_anything_runs(tmp_path):
    from quark_ptq_eval.flows.sweep import load_grid

    grid = tmp_path / "grid.yaml"
    grid.write_text("models: [a, b]\nschemes: int8,fp8\noptions: {calib_data: c.txt, max_windows: 4}\n")
    g = load_grid(grid)
    assert g.models == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")} and g.schemes == ["int8", "fp8"]
    assert g.options == {"calib_data": str(tmp_path / "c.txt"), "max_windows": 4} and g.goals == [""]
    for text, words in (("schemes: [int8]\n", "needs `models` and `schemes`"),
                        ("models: [a]\nschemes: [int8]\noptions: {no_such: 1}\n", "Unknown option(s)"),
                        ("models: [a\n", "not valid YAML")):
        grid.write_text(text)
        with pytest.raises(UsageError) as exc:
            load_grid(grid)
        assert words in exc.value.message


def test_an_address_nothing_listens_on_is_refused_in_seconds_not_retried():
    """Ray 2.60's `ray.init` on a dead HOST:PORT retries its GCS for minutes; --ray checks the port first
    (how long each takes: `python -m bench.benchmarks.bench_ray_dead_address`)."""
    import socket

    from quark_ptq_eval.flows.compare.ray_cluster import check_answers

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_answers(f"127.0.0.1:{port}")  # something answers: Ray is asked
        check_answers(f"ray://127.0.0.1:{port}")
    with pytest.raises(UsageError, match=f"No Ray cluster answers at 127.0.0.1:{port} \\(Connection refused\\)"):
        check_answers(f"127.0.0.1:{port}")  # the kernel's refusal, not a timeout
    with pytest.raises(UsageError, match="is not an address Ray can join"):
        check_answers("head-node")
    check_answers("auto")
    check_answers("local")
