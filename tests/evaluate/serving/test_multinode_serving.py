"""vLLM across nodes for Tier 3: a server the planner sizes wider than one node runs tensor parallel within
a node, pipeline parallel across nodes, over Ray; its script brings the cluster up (and its srun form) and
checks the cluster's GPUs before any server starts. Fast: no model, no vLLM, no Ray."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from quark_ptq_eval.evaluate import EvalOptions
from quark_ptq_eval.evaluate.serving.commands import ServedModel, plan_commands, server_argv
from quark_ptq_eval.evaluate.serving.detect import Environment
from quark_ptq_eval.evaluate.serving.multinode import gpu_check_lines, layout_for, parallel_args
from quark_ptq_eval.evaluate.vllm.script import write_script

ROCM = Environment(rocm=True, rocm_evidence=["test"], docker=True, in_container=False, vllm=False, lm_eval_api=False)


@pytest.mark.parametrize(("devices", "tp", "pp"), [(1, 1, 1), (4, 4, 1), (8, 8, 1), (16, 8, 2), (32, 8, 4), (12, 8, 2)])
def test_layout_is_tensor_parallel_in_a_node_and_pipeline_parallel_across(devices, tp, pp):
    layout = layout_for(devices)
    assert (layout.tensor_parallel, layout.pipeline_parallel) == (tp, pp) and layout.devices >= devices
    args = parallel_args(devices)
    assert args[:2] == ["--tensor-parallel-size", str(tp)]
    assert ("--distributed-executor-backend" in args) == (pp > 1)
    if pp > 1:
        assert args[2:] == ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "ray"]
    assert parallel_args(None) == []


def _script(tmp_path: Path, quantized_tp: int, baseline_tp: int) -> str:
    models = [ServedModel("quantized", tmp_path / "q", "quantized", quantized_tp),
              ServedModel("baseline", tmp_path / "b", "baseline", baseline_tp)]
    options = EvalOptions(tier="vllm")
    commands = plan_commands(models, options, tmp_path, "docker", ROCM)
    script, steps = write_script(commands, models, options, tmp_path)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    serve = {m.label: " ".join(server_argv(m, options)) for m in models}
    assert "--distributed-executor-backend ray" not in serve["quantized"]
    return script.read_text()


def test_a_baseline_wider_than_a_node_gets_the_ray_lines_and_the_gpu_check(tmp_path):
    text = _script(tmp_path, 8, 16)
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2 --distributed-executor-backend ray" in text
    assert "ray start --head --port 6379 --num-gpus 8" in text and "ray start --address HEAD_IP:6379" in text
    assert 'srun --nodes=1 --ntasks=1 -w "$head" ray start --head' in text and "srun --nodes=1 --ntasks=1 --exclude" in text
    assert text.index("RAY_GPUS=") < text.index("start_server quantized")  # checked before any server starts


def test_servers_within_one_node_get_no_ray_section(tmp_path):
    text = _script(tmp_path, 2, 8)
    assert "ray start" not in text and "RAY_GPUS" not in text and "--pipeline-parallel-size" not in text


@pytest.mark.parametrize(("gpus", "rc"), [(8, 1), (16, 0)])
def test_the_gpu_check_stops_a_cluster_that_is_too_small(gpus, rc):
    body = "\n".join(gpu_check_lines(layout_for(16)))
    shell = f'run_in() {{ [ "$1" = python3 ] && echo {gpus}; }}\nsay() {{ echo "$*" >&2; }}\n{body}\necho ok\n'
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True)
    assert proc.returncode == rc
    if rc:
        assert "the Ray cluster has 8 GPUs; this server needs 16 (2 nodes of 8)" in proc.stderr
    else:
        assert proc.stdout.strip() == "ok"
