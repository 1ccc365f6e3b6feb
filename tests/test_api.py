"""The Python API: the same steps as the CLI over typed artifacts, with a pluggable approver."""

import pytest

import quark_ptq_eval as qpe
from quark_ptq_eval import contracts


def test_steps_as_functions_return_typed_artifacts(tiny_llama, corpus, tmp_path):
    analysis = qpe.analyze_model(tiny_llama, offline=True, workdir=tmp_path)
    assert isinstance(analysis, qpe.ModelAnalysis) and (tmp_path / "model_analysis.json").exists()
    plan = qpe.plan_quantization(analysis, tmp_path / "out", workdir=tmp_path, scheme="fp8", calib_data=str(corpus))
    assert isinstance(plan, qpe.QuantPlan) and plan.global_scheme == "fp8"
    manifest = qpe.build_manifest(plan, tmp_path, offline=True)
    assert isinstance(manifest, qpe.RunManifest)
    loaded = qpe.RunManifest.load(tmp_path)
    assert loaded.command["argv"] == manifest.command["argv"]
    assert contracts.schema_errors("run_manifest", loaded.to_dict()) == []


def test_callback_approver_drives_the_gates(tiny_llama, corpus, tmp_path):
    seen = []

    def approve(gate, summary):
        seen.append(gate.name)
        return gate.name != "execute"

    with pytest.raises(qpe.CheckpointPending, match="checkpoint 3"):
        qpe.run(tiny_llama, tmp_path / "out", workdir=tmp_path / "w", approver=qpe.CallbackApprover(approve),
                scheme="int8", calib_data=str(corpus), offline=True)
    assert seen == ["intake", "plan", "execute"]
    assert not (tmp_path / "out").exists()
    # resuming with the same approver asks only for the gate still open
    seen.clear()
    with pytest.raises(qpe.CheckpointPending):
        qpe.run(None, None, workdir=tmp_path / "w", approver=qpe.CallbackApprover(approve))
    assert seen == ["execute"]
