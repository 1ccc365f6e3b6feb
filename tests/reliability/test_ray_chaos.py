"""The Ray chaos campaign's seeded slice (bench/benchmarks/ray_chaos.py runs the figure): a loopback cluster of three
nodes brought up with `ray start` (a head and two 1-CPU workers), one undisturbed `compare --ray` of one scheme as
the reference, then the same compare from scratch with a seeded fault (a worker node SIGKILLed while it runs a
cell): every cell's export bytes, validation and Tier 1 figures equal the reference's, no cell completed twice,
nothing half-written read, the report naming what Ray retried. And the planted bug (a cell's result written before
its export is complete, planted into the workers' real execute step): the campaign's checks report the mismatch.
The other kinds (the driver killed and resumed, a node replaced, an engine killed mid-export) are the campaign's
to cover: each trial here is a full compare on the cluster (engines, validation with the load check, Tier 1).

Slow: three compares on the cluster."""

from __future__ import annotations

import random

import pytest
import yaml

from bench.benchmarks import ray_chaos

pytestmark = pytest.mark.slow
SCHEMES = ["int8"]  # the slice's compare: one cell (the campaign's have three, and a sweep's two)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, tiny_llama, corpus, compare_eval_text):
    """The cluster and the undisturbed compare's cells, for the module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ray_chaos.SCHEMES, "compare", SCHEMES)
        where = tmp_path_factory.mktemp("ray-chaos")
        assets = ray_chaos.Assets({"llama": tiny_llama}, corpus, compare_eval_text)
        try:
            cluster = ray_chaos.LoopbackCluster(where / "cluster")
        except SystemExit as exc:  # Ray gives a raylet 30 s to register: a loaded host's capacity, not the product's
            pytest.skip(f"the loopback cluster's worker nodes did not come up on this host: {exc}")
        try:
            span, refs = ray_chaos.take_reference("compare", cluster, assets, where / "reference")
            yield {"cluster": cluster, "assets": assets, "span": span, "refs": refs, "where": where, "mp": mp}
        finally:
            cluster.shutdown()


def _trial(chaos, number: int, kind: str, **kwargs) -> ray_chaos.Trial:
    return ray_chaos.run_trial(number, "compare", kind, chaos["span"], chaos["refs"], chaos["cluster"],
                               chaos["assets"], chaos["where"] / f"trial-{number}", random.Random(number), **kwargs)


def test_the_reference_is_every_cell_evaluated_and_validated(chaos):
    assert set(chaos["refs"]) == {f"compare:compare/{s}" for s in SCHEMES}
    for ref in chaos["refs"].values():
        assert ref.figures["status"] == "evaluated" and ref.validation["status"] == "success"
        assert any(name.endswith(".safetensors") for name in ref.export)


def test_a_worker_node_killed_at_a_seeded_instant_ends_with_every_cell_as_undisturbed(chaos):
    trial = _trial(chaos, 1, "worker_kill", engine_mode="engine", instant=0.0)  # the node of the first engine
    assert trial.fault.get("struck") and trial.fault["held_cell"], trial.fault
    assert trial.mismatches == [], trial
    assert trial.retries == 1 and trial.reported_retried == ["compare/int8"], trial  # Ray retried it; the report says so


def test_a_result_written_before_its_export_is_complete_is_a_mismatch(chaos):
    """The planted bug: each worker of the driver's job runs the execute step without its judgement of the engine's
    run, so a cell whose engine is killed before its export is complete has its partial export renamed into place
    and recorded succeeded."""
    # one re-run: enough for the real code (the killed engine's cell fails at execute, the re-run sets its partial
    # aside and completes it: the campaign's engine_kill trials), not for the planted one (validation fails again)
    chaos["mp"].setattr(ray_chaos, "MAX_RESUMES", 1)
    trial = _trial(chaos, 3, "engine_kill", plant="early-result", engine_mode="early", instant=0.0)  # the first engine
    assert trial.fault.get("struck"), trial.fault
    runs = yaml.safe_load((chaos["where"] / "trial-3" / "out" / "work" / trial.fault["cell"].split("/")[-1]
                           / "run_manifest.yaml").read_text())["runs"]
    assert runs[0]["status"] == "succeeded" and "returncode" not in runs[0]  # the plant acted: the killed run's result
    # the half export was validated (failed), or the re-run ran the engine again (a second completion): a mismatch
    assert any(m.startswith(trial.fault["cell"]) for m in trial.mismatches), trial.mismatches
