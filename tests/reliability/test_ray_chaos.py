"""The Ray chaos campaign's seeded slice (bench/benchmarks/ray_chaos.py runs the figure): the planted bug. A loopback
cluster of three nodes brought up with `ray start` (a head and two 1-CPU workers), one undisturbed compare of one
scheme as the reference (run locally: a cell's results do not depend on where it ran), then the same compare on the
cluster with a cell's result written before its export is complete (planted into the workers' real execute step)
and its engine killed early: the campaign's checks report the mismatch. The campaign's checks on real code in the
suite are test_compare_ray.py's (a node lost while its cell's engine runs, against the local comparison); the other
kinds (the driver killed and resumed, a node replaced, an engine killed mid-export) are the campaign's to cover.

Slow: two compares on the cluster (the planted run and its re-run), one local."""

from __future__ import annotations

import random

import pytest
import yaml

from bench.benchmarks import ray_chaos

pytestmark = pytest.mark.slow
SCHEMES = ["int8"]  # the slice's compare: one cell (the campaign's have three, and a sweep's two)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, tiny_llama, corpus, compare_eval_text):
    """The cluster, and the undisturbed compare's cells for the module: the reference runs here, in this process and
    without Ray (its engine forked from the suite's engine host), with the trials' own options. A cell's export,
    validation and Tier 1 figures do not depend on where it ran (test_compare_ray's Ray comparison equals the local
    one but for timings and nodes); the campaign's reference runs on its cluster, as its trials do."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ray_chaos.SCHEMES, "compare", SCHEMES)
        where = tmp_path_factory.mktemp("ray-chaos")
        assets = ray_chaos.Assets({"llama": tiny_llama}, corpus, compare_eval_text)
        refs = _local_reference(assets, where / "reference" / "out")
        try:
            cluster = ray_chaos.LoopbackCluster(where / "cluster")
        except SystemExit as exc:  # Ray gives a raylet 30 s to register: a loaded host's capacity, not the product's
            pytest.skip(f"the loopback cluster's worker nodes did not come up on this host: {exc}")
        try:
            yield {"cluster": cluster, "assets": assets, "refs": refs, "where": where, "mp": mp}
        finally:
            cluster.shutdown()


def _local_reference(assets: ray_chaos.Assets, out) -> dict[str, ray_chaos.CellResult]:
    from quark_ptq_eval import compare
    from quark_ptq_eval.base.gates import FlagApprover

    compare(assets.models["llama"], SCHEMES, out, calib_data=str(assets.corpus), eval_data=assets.eval_text,
            approver=FlagApprover(ray_chaos.APPROVE.split(",")), quiet=True, **ray_chaos.OPTIONS)
    return {f"compare:compare/{s}": ray_chaos.cell_result(out, s) for s in SCHEMES}


def _trial(chaos, number: int, kind: str, **kwargs) -> ray_chaos.Trial:
    return ray_chaos.run_trial(number, "compare", kind, 0.0, chaos["refs"], chaos["cluster"],
                               chaos["assets"], chaos["where"] / f"trial-{number}", random.Random(number), **kwargs)


def test_the_reference_is_every_cell_evaluated_and_validated(chaos):
    assert set(chaos["refs"]) == {f"compare:compare/{s}" for s in SCHEMES}
    for ref in chaos["refs"].values():
        assert ref.figures["status"] == "evaluated" and ref.validation["status"] == "success"
        assert any(name.endswith(".safetensors") for name in ref.export)


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
