"""The Ray cluster a comparison or sweep runs its cells on: connecting (``--ray ADDRESS``), its live
nodes, the output root checked from every node, and what one cell asks of a node.

``import ray`` happens only in these functions, when ``--ray`` (or ``ray=`` in the Python API) asks
for it: the package is an extra (``pip install quark-ptq-eval[ray]``).
"""

from __future__ import annotations

import math
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.sizes import gb

LOCAL, AUTO = "local", "auto"
PROBE_PREFIX = ".ray_probe-"
ANSWER_TIMEOUT_S = 5.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs the Ray package, which is not installed here.",
                         "Install it with `pip install quark-ptq-eval[ray]` (on every node), then re-run.") from None
    return ray


def connect(address: str) -> str:
    """Join the cluster at ``address`` (``auto``: the one `ray start` brought up on this node;
    ``local``: start one on this host); an already connected driver (tests, a notebook) keeps its own.
    Returns the address as shown in the report."""
    ray = import_ray()
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    check_answers(address)
    try:
        if address == LOCAL:
            ray.init(log_to_driver=False, include_dashboard=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise _no_cluster(address, str(exc)) from None
    return ray.get_runtime_context().gcs_address


def check_answers(address: str) -> None:
    """Refuse a ``HOST:PORT`` nothing listens on: given one, ``ray.init`` retries the GCS for minutes
    (measured: still waiting after 200 s on Ray 2.60) instead of failing."""
    if address in (LOCAL, AUTO):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ray {address} is not an address Ray can join.",
                         "Pass HOST:PORT (the head's GCS port, 6379 by default), auto or local.")
    try:
        socket.create_connection((host, int(port)), timeout=ANSWER_TIMEOUT_S).close()
    except OSError as exc:
        raise _no_cluster(address, exc.strerror or type(exc).__name__) from None


def _no_cluster(address: str, why: str) -> UsageError:
    return UsageError(f"No Ray cluster answers at {address} ({why}).",
                      "Start one (`ray start --head` on the head node, `ray start --address HEAD:6379` on the "
                      "others), pass its address with --ray ADDRESS, or use --ray local.")


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    resources: dict[str, float]

    @property
    def name(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


def alive_nodes() -> list[Node]:
    ray = import_ray()
    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources") or {}))
            for n in ray.nodes() if n.get("Alive")]


def node_name(node_id: str | None, ip: str | None) -> str:
    return f"{ip or '?'} ({(node_id or '?')[:8]})"


def is_alive(node_id: str | None) -> bool:
    return any(n.node_id == node_id for n in alive_nodes())


def _read_probe(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError:
        return None


def check_shared_root(root: Path, nodes: list[Node]) -> None:
    """Every node must see the output root (work dirs, models, the baseline cache live there):
    a file written here is read back by a zero-CPU task pinned to each node."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    probe = root / f"{PROBE_PREFIX}{token}"
    probe.write_text(token, encoding="utf-8")
    try:
        reader = ray.remote(num_cpus=0, max_retries=0)(_read_probe)
        refs = {n.name: reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                .remote(str(probe)) for n in nodes}
        unseen = [name for name, ref in refs.items() if ray.get(ref, timeout=120) != token]
    finally:
        probe.unlink(missing_ok=True)
    if unseen:
        raise UsageError(f"The output root {root} is not visible from Ray node(s) {', '.join(unseen)}; "
                         "every cell writes its work dir and model there and reads the shared baseline cache.",
                         "Pass -o on a file system every node mounts (NFS, Lustre, ...), or run without --ray.")


@dataclass
class Demand:
    """What one cell asks of a node: from its plan's device strategy and host-memory model."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int = 0  # bytes: the larger of the engine's and the evaluation's host peak
    basis: list[str] = field(default_factory=list)

    def options(self) -> dict[str, Any]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "memory": self.memory}

    def text(self) -> str:
        gpus = f", {self.num_gpus:g} GPU" if self.num_gpus else ""
        return f"{self.num_cpus:g} CPU{gpus}, {gb(self.memory)}"


def demand_of(plan) -> Demand:
    """GPUs from the plan's device count (one, or every GPU with multi-device), memory from its host
    peak: the engine's (plan.resources quantize) or its Tier 1's, whichever is larger. One CPU: the
    engine is one process (torch threads over what the node gives it)."""
    res = plan.resources or {}
    quantize = (res.get("quantize") or {}).get("host_peak_bytes") or 0
    evaluate = (res.get("evaluate") or {}).get("host_peak_bytes") or 0
    device = plan.device_strategy
    gpus = 0.0
    if device.device != "cpu":
        gpus = float(max(1, device.gpu_count) if device.multi_device else 1)
    return Demand(num_gpus=gpus, memory=int(max(quantize, evaluate)),
                  basis=[f"engine host peak {gb(quantize)}", f"Tier 1 host peak {gb(evaluate)}"])


def check_fits(demands: dict[str, Demand], nodes: list[Node]) -> None:
    """A cell no node can hold would wait forever: refuse it up front, naming the largest node."""
    for scheme, d in demands.items():
        if any(n.resources.get("CPU", 0) >= d.num_cpus and n.resources.get("GPU", 0) >= d.num_gpus
               and n.resources.get("memory", math.inf) >= d.memory for n in nodes):
            continue
        best = max(nodes, key=lambda n: (n.resources.get("GPU", 0), n.resources.get("memory", 0)), default=None)
        has = (f"the largest node, {best.name}, has {best.resources.get('CPU', 0):g} CPU, "
               f"{best.resources.get('GPU', 0):g} GPU and {gb(int(best.resources.get('memory', 0)))}"
               if best else "the cluster has no live node")
        raise UsageError(f"The {scheme} cell asks for {d.text()} ({'; '.join(d.basis)}); {has}.",
                         "Add a node that holds it, or leave the scheme out of this comparison.")


def speed_demand(devices: int | None, gpu: bool) -> Demand:
    """What a speed cell (compare --speed) asks of a node: the GPUs its server is sized for (Tier 3's sizing:
    the plan's serving fit, one when it sizes none), as whole GPUs: Ray hands a reserved whole GPU to no
    other task, so no other cell shares them while this one measures. A CPU vLLM reserves no GPU: its cells
    are run one at a time (on_ray.py), since a CPU server shares the cores with whatever else runs."""
    gpus = float(max(1, devices or 1)) if gpu else 0.0
    basis = [f"its vLLM server on {gpus:g} GPU (Tier 3's sizing), held alone while it measures" if gpu else
             "a CPU vLLM server: one speed cell at a time"]
    return Demand(num_cpus=1.0, num_gpus=gpus, basis=basis)
