"""vLLM across nodes, for Tier 3 and the serving check: when the planner finds a model (or its
baseline) needs more GPUs than one node of the target holds, the server runs on a Ray cluster
(``--distributed-executor-backend ray``, vLLM's multi-node engine): tensor parallel within a node,
pipeline parallel across nodes. The script that serves it holds the lines that bring the cluster up
on each node, and their ``srun`` form for a Slurm allocation (docs/distributed.md).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

GPUS_PER_NODE = 8  # an MI300X / MI325X / MI355X platform and an HGX H100 / H200 / B200 node: 8 GPUs each
RAY_PORT = 6379


@dataclass(frozen=True)
class Layout:
    """How one server's devices are laid out: ``tensor_parallel`` GPUs per node, ``pipeline_parallel`` nodes."""

    devices: int
    tensor_parallel: int
    pipeline_parallel: int

    @property
    def nodes(self) -> int:
        return self.pipeline_parallel

    @property
    def multi_node(self) -> bool:
        return self.pipeline_parallel > 1

    def text(self) -> str:
        if not self.multi_node:
            return f"{self.tensor_parallel} GPU(s) on one node (tensor parallel {self.tensor_parallel})"
        return (f"{self.devices} GPUs on {self.nodes} nodes of {self.tensor_parallel}: tensor parallel "
                f"{self.tensor_parallel} within a node, pipeline parallel {self.pipeline_parallel} across nodes, "
                "over Ray")


def layout_for(devices: int, per_node: int = GPUS_PER_NODE) -> Layout:
    """The planner's device count (a power of two) as one node's tensor parallelism, or whole nodes
    of ``per_node`` GPUs, pipelined: vLLM's tensor parallelism needs the fast links inside a node."""
    devices = max(1, int(devices))
    if devices <= per_node:
        return Layout(devices, devices, 1)
    nodes = math.ceil(devices / per_node)
    return Layout(nodes * per_node, per_node, nodes)


def parallel_args(devices: int | None, per_node: int = GPUS_PER_NODE) -> list[str]:
    """vLLM's parallelism flags for ``devices`` GPUs (none: vLLM's default of one)."""
    if not devices:
        return []
    layout = layout_for(devices, per_node)
    args = ["--tensor-parallel-size", str(layout.tensor_parallel)]
    if layout.multi_node:
        args += ["--pipeline-parallel-size", str(layout.pipeline_parallel), "--distributed-executor-backend", "ray"]
    return args


def bring_up_lines(layout: Layout, port: int = RAY_PORT) -> list[str]:
    """Shell lines (comments, as they run on other machines) that start the Ray cluster vLLM spans."""
    gpus = layout.tensor_parallel
    workers = layout.nodes - 1
    return [
        f"# This server spans {layout.text()}. Before running this script, bring a Ray cluster up",
        "# across those nodes, in the same vLLM environment (image) on each, with the model at the same path:",
        f"#   head node:        ray start --head --port {port} --num-gpus {gpus}",
        f"#   each other node:  ray start --address HEAD_IP:{port} --num-gpus {gpus}   ({workers} node(s))",
        "# then run this script on the head node. In a Slurm allocation "
        f"(sbatch --nodes {layout.nodes} --gpus-per-node {gpus}):",
        '#   head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        '#   head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address)',
        f'#   srun --nodes=1 --ntasks=1 -w "$head" ray start --head --node-ip-address="$head_ip" --port={port} '
        f"--num-gpus {gpus} --block &",
        f'#   srun --nodes={workers} --ntasks={workers} --exclude="$head" ray start --address "$head_ip:{port}" '
        f"--num-gpus {gpus} --block &",
        "#   sleep 30  # the workers join; then this script, on the head node",
    ]


def gpu_check_lines(layout: Layout) -> list[str]:
    """Script lines: stop before any server starts when the Ray cluster has fewer GPUs than the layout."""
    code = 'import ray; ray.init(address="auto"); print(int(ray.cluster_resources().get("GPU", 0)))'
    return [
        f'RAY_GPUS="$(run_in python3 -c {shlex.quote(code)} || echo 0)"',
        f'if [ "${{RAY_GPUS:-0}}" -lt {layout.devices} ]; then',
        f'  say "the Ray cluster has ${{RAY_GPUS:-0}} GPUs; this server needs {layout.devices} '
        f'({layout.nodes} nodes of {layout.tensor_parallel}): bring the nodes up (see above) and re-run."',
        "  exit 1",
        "fi",
    ]


def script_block(devices: list[int | None], per_node: int = GPUS_PER_NODE) -> list[str]:
    """The Tier 3 script's Ray section: empty when every server fits one node."""
    layouts = [layout_for(d, per_node) for d in devices if d]
    wide = max((x for x in layouts if x.multi_node), key=lambda x: x.devices, default=None)
    if wide is None:
        return []
    return ["", *bring_up_lines(wide), *gpu_check_lines(wide)]
