"""Phase 1 steps 2-3: recommendations, refusals, and the exact command for every plan feature."""

import os
import shlex
import sys
from pathlib import Path

import pytest

from quark_ptq_eval.base import contracts
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.intake import analyze_model
from quark_ptq_eval.manifest import build_manifest
from quark_ptq_eval.plan import PlanRequest, make_plan


def env(accelerator="cpu", arch=None, memory_gb=0):
    return {"environment": {"os": "Linux", "python": "3.11", "containerized": False},
            "hardware": {"accelerator": accelerator, "gpu_arch": arch, "memory_gb": memory_gb,
                         "gpu_count": 0 if accelerator == "cpu" else 1}}


@pytest.fixture(scope="module")
def analysis(tiny_llama, catalog):
    return analyze_model(str(tiny_llama), offline=True, catalog=catalog)


@pytest.fixture
def plan_for(analysis, catalog, tmp_path, corpus):
    def make(hw=None, **request):
        request.setdefault("calib_data", str(corpus))
        return make_plan(analysis, hw or env(), PlanRequest(**request), catalog, tmp_path / "model_analysis.json",
                         tmp_path / "out")
    return make


@pytest.mark.parametrize(
    "goal, hw, scheme, algorithm",
    [
        ("fp8 for MI300X, accuracy first", env("amd-rocm", "gfx942"), "fp8", None),
        ("", env("amd-rocm", "gfx942:sramecc+:xnack-"), "fp8", None),
        ("", env("amd-rocm", "gfx950"), "mxfp4", None),
        ("", env("nvidia-cuda", "sm_90"), "fp8", None),
        ("", env(), "int8", None),
        ("int4, accuracy first", env("amd-rocm", "gfx942"), "int4_wo_128", "awq"),
        ("smallest model that fits", env("amd-rocm", "gfx942"), "int4_wo_128", None),
    ],
)
def test_recommendation_follows_goal_and_hardware(plan_for, goal, hw, scheme, algorithm):
    plan = plan_for(hw, goal=goal)
    assert (plan.global_scheme, plan.algorithm) == (scheme, algorithm)
    assert all(d["reason"] for d in plan.decisions)
    assert plan.requires_confirmation is True
    assert contracts.schema_errors("quant_plan", plan.to_dict()) == []


def test_every_supported_scheme_name_comes_from_installed_quark(plan_for, catalog):
    for scheme in ("int8", "fp8", "int4_wo_128", "mxfp4", "nvfp4"):
        assert scheme in catalog["schemes"]
        assert plan_for(scheme=scheme).global_scheme == scheme


@pytest.mark.parametrize(
    "request_, message",
    [
        ({"scheme": "fp8", "algorithm": "awq"}, "weight-only algorithm"),
        ({"scheme": "int4_wo_128", "algorithm": "smoothquant"}, "no effect on the weight-only"),
        ({"scheme": "int8", "kv_cache_scheme": "int8_per_token"}, "rejects the KV-cache scheme"),
        ({"scheme": "int3_magic"}, "does not support the scheme"),
        ({"scheme": "int8", "layer_quant_config": {"*down_proj": "int2"}}, "does not support the scheme 'int2'"),
        ({"scheme": "int8", "algorithm": "nope"}, "not available"),
        ({"scheme": "int8", "exclude_layers": []}, "empty exclusion list"),
        ({"scheme": "int8", "calib_data": None, "offline": True}, "needs local calibration text"),
        ({"scheme": "int8", "calib_data": "/nonexistent/calib.txt"}, "does not exist"),
    ],
)
def test_incompatible_plans_are_refused_with_the_reason(plan_for, request_, message):
    with pytest.raises(UsageError, match=message):
        plan_for(**request_)


def test_unknown_model_type_is_refused_at_plan(analysis, catalog, tmp_path, corpus):
    import copy

    other = copy.deepcopy(analysis)
    other.model["model_type"] = "my_new_arch"
    other.template["available"] = False
    with pytest.raises(UsageError, match="no template for model_type 'my_new_arch'"):
        make_plan(other, env(), PlanRequest(scheme="int8", calib_data=str(corpus)), catalog, tmp_path / "a", tmp_path / "o")


def flags(argv):
    return [a for a in argv if a.startswith("--")]


def manifest_for(plan, tmp_path, offline=True):
    return build_manifest(plan, tmp_path, tmp_path / "out", offline=offline, engine_version="0.13")


def test_api_engine_command_for_every_plan_feature(plan_for, tmp_path, corpus):
    plan = plan_for(scheme="int4_wo_128", algorithm="awq", kv_cache_scheme="fp8", exclude_layers=["lm_head", "*.0.mlp.*"],
                    layer_quant_config={"*down_proj": "int4_wo_32", "*o_proj": "fp8"}, num_calib_samples=8,
                    calib_seq_len=64, batch_size=2)
    m = manifest_for(plan, tmp_path)
    argv = m.command["argv"]
    assert argv[:3] == [sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine"]
    joined = " ".join(argv)
    for expected in ("--quant_scheme int4_wo_128", "--quant_algo awq", "--kv_cache_dtype fp8",
                     "--layer_quant_scheme *down_proj int4_wo_32", "--layer_quant_scheme *o_proj fp8",
                     "--num_calib_data 8", "--seq_len 64", "--batch_size 2", f"--calib_data {corpus}",
                     "--exclude_layers lm_head *.0.mlp.*", "--device cpu"):
        assert expected in joined
    assert "--trust_remote_code" not in argv
    assert shlex.split(m.command["shell"])[-len(argv):] == argv
    assert m.command["env"]["HF_HUB_OFFLINE"] == "1"
    assert all(Path(p).is_absolute() for p in (argv[argv.index("--model_dir") + 1], argv[argv.index("--output_dir") + 1]))
    assert argv[argv.index("--output_dir") + 1].endswith("out.partial")
    assert contracts.schema_errors("run_manifest", m.to_dict()) == []


def test_exclusions_are_spelled_out_and_no_exclusions_emits_an_empty_flag(plan_for, tmp_path):
    default = manifest_for(plan_for(scheme="int8"), tmp_path).command["argv"]
    assert default[default.index("--exclude_layers") + 1] == "lm_head"  # the template's default, explicit
    none = manifest_for(plan_for(scheme="int8", no_exclusions=True), tmp_path).command["argv"]
    assert none[none.index("--exclude_layers") + 1:] == [] or none[none.index("--exclude_layers") + 1].startswith("--")


def test_quark_cli_engine_command_flags_all_exist_in_installed_help(plan_for, tmp_path):
    from quark_ptq_eval.context.quark_cli import quark_cli_flags

    plan = plan_for(env("amd-rocm", "gfx942", 192), scheme="int4_wo_128", algorithm="awq", kv_cache_scheme="fp8",
                    exclude_layers=["lm_head"], layer_quant_config={"*down_proj": "fp8"}, multi_device=True)
    assert plan.engine.name == "quark-cli"
    m = manifest_for(plan, tmp_path, offline=False)
    argv = m.command["argv"]
    assert argv[1] == "torch-llm-ptq" and Path(argv[0]).name == "quark-cli"
    used = set(flags(argv))
    assert used <= quark_cli_flags(), used - quark_cli_flags()
    for required in ("--no_trust_remote_code", "--multi_device", "--skip_evaluation", "--dataset", "--device"):
        assert required in used
    assert "--calib_data" not in used
    # local text for quark-cli is served from a private cache named in the manifest's env
    assert m.command["env"]["HF_DATASETS_CACHE"].startswith(str(tmp_path))
    assert any(s["name"] == "prepare_calibration" for s in m.steps)


def test_hub_dataset_calibration_online(plan_for, tmp_path):
    plan = plan_for(env("amd-rocm", "gfx942"), scheme="fp8", calib_data=None)
    assert plan.calibration.source == "hub_dataset" and plan.calibration.dataset == "pileval"
    argv = manifest_for(plan, tmp_path, offline=False).command["argv"]
    assert argv[argv.index("--dataset") + 1] == "pileval"


def test_hostile_paths_stay_single_arguments(analysis, catalog, tmp_path, corpus):
    import copy

    evil = tmp_path / "x; touch PWNED $(id) `id` 'q\" ü"
    other = copy.deepcopy(analysis)
    other.model["model_path"] = str(evil)
    plan = make_plan(other, env(), PlanRequest(scheme="int8", calib_data=str(corpus)), catalog, tmp_path / "a", tmp_path / "o")
    m = manifest_for(plan, tmp_path)
    argv = m.command["argv"]
    assert argv[argv.index("--model_dir") + 1] == str(evil)
    assert shlex.split(m.command["shell"])[-len(argv):] == argv


def test_trust_remote_code_is_never_implied(plan_for, tmp_path):
    plan = plan_for(env("amd-rocm", "gfx942"), scheme="fp8")
    assert plan.trust_remote_code is False
    assert "--no_trust_remote_code" in manifest_for(plan, tmp_path).command["argv"]
    approved = plan_for(scheme="int8", trust_remote_code=True)
    assert "--trust_remote_code" in manifest_for(approved, tmp_path).command["argv"]


def test_an_unchanged_plan_is_not_written_again(plan_for, tmp_path):
    plan, workdir = plan_for(), tmp_path / "work"
    workdir.mkdir()
    assert plan.write_if_changed(workdir)
    path = plan.path_in(workdir)
    os.utime(path, ns=(1, 1))  # an mtime no write can leave
    assert not plan.write_if_changed(workdir) and path.stat().st_mtime_ns == 1
    plan.requires_confirmation = False  # checkpoint 2 approved it: the content changes, so it is written
    assert plan.write_if_changed(workdir) and path.stat().st_mtime_ns != 1
