"""The Python API: the same steps as the CLI over typed artifacts, with a pluggable approver."""

import pytest

import quark_ptq_eval as qpe
from quark_ptq_eval.base import contracts


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


def test_every_artifact_validates_against_ours_and_quarks_contracts(tiny_llama, corpus, tmp_path, cli):
    import json

    import yaml

    wd = tmp_path / "w"
    res = cli("run", tiny_llama, "-o", tmp_path / "out", "--workdir", wd, "--scheme", "int8", "--calib-data", corpus,
              "--offline", "--approve", "intake,plan")
    assert res.rc == 3, res.err
    kinds = ["session_context", "env_context", "workspace_context", "pytorch_install_result", "quark_install_result",
             "model_analysis", "quant_plan"]
    for kind in kinds:
        data = json.loads((wd / f"{kind}.json").read_text())
        assert contracts.quark_contract(kind) is not None, kind
        assert contracts.schema_errors(kind, data) == [], kind
    manifest = yaml.safe_load((wd / "run_manifest.yaml").read_text())
    assert contracts.own_schema("run_manifest") and contracts.schema_errors("run_manifest", manifest) == []
    session = json.loads((wd / "session_context.json").read_text())
    assert session["constraints"] == {"offline": True, "execution_mode": "batch_execute"}


def test_a_given_context_file_is_validated_and_names_the_field(tiny_llama, corpus, tmp_path, cli):
    import json

    bad = tmp_path / "env_context.json"
    bad.write_text(json.dumps({"environment": {"os": "Linux", "python": "3.11", "containerized": False},
                               "hardware": {"accelerator": "tpu"}}))
    res = cli("run", tiny_llama, "-o", tmp_path / "out", "--workdir", tmp_path / "w", "--scheme", "int8",
              "--calib-data", corpus, "--offline", "--env-context", bad)
    assert res.rc == 2 and "hardware/accelerator" in res.err and "Traceback" not in res.err
    good = tmp_path / "env_rocm.json"
    good.write_text(json.dumps({"environment": {"os": "Linux", "python": "3.11", "containerized": True},
                                "hardware": {"accelerator": "amd-rocm", "gpu_arch": "gfx942", "gpu_count": 8,
                                             "memory_gb": 192}}))
    res = cli("plan", tiny_llama, "-o", tmp_path / "out2", "--workdir", tmp_path / "w2", "--calib-data", corpus,
              "--num-calib-samples", "32", "--offline", "--env-context", good, "--approve", "intake", "--json")
    assert res.rc == 0, res.err
    plan = json.loads((tmp_path / "w2" / "quant_plan.json").read_text())
    assert plan["global_scheme"] == "fp8" and plan["engine"]["name"] == "quark-cli"


def test_a_session_context_that_says_offline_makes_the_run_offline_from_its_start(tiny_llama, tmp_path, cli):
    """Offline is settled once, before the model resolves: the given session context's constraint counts as
    --offline would (a Hub calibration dataset is then refused up front)."""
    import json

    from quark_ptq_eval.context.preflight import session as session_context

    session = tmp_path / "session_context.json"
    session.write_text(json.dumps(session_context("int8", True, "batch_execute", tmp_path)))
    res = cli("plan", tiny_llama, "-o", tmp_path / "out", "--workdir", tmp_path / "w", "--scheme", "int8",
              "--session-context", session, "--yes")
    assert res.rc == 2 and "local calibration text" in res.err and "Traceback" not in res.err, res.err
