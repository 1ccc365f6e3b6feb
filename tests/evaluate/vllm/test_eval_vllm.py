"""Tier 3: deferred commands off ROCm, command building for docker and host, and a faked ROCm run."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import CheckpointPending, QpeError
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.evaluate import EvalOptions, evaluate
from quark_ptq_eval.evaluate.context import TierInputs
from quark_ptq_eval.evaluate.vllm import tier as t3

NO_ROCM = t3.Environment(
    rocm=False, rocm_evidence=[], docker=False, in_container=False, vllm=False, lm_eval_api=False
)
ROCM_DOCKER = t3.Environment(
    rocm=True,
    rocm_evidence=["rocm-smi on PATH"],
    docker=True,
    in_container=False,
    vllm=False,
    lm_eval_api=False,
)


def fake_model(root: Path, name: str, chat_template: str | None = None, max_pos: int = 40960) -> Path:
    model = root / name
    model.mkdir(parents=True)
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "max_position_embeddings": max_pos})
    )
    (model / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": chat_template} if chat_template else {})
    )
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    return model


def test_this_host_has_no_rocm_so_commands_are_deferred(tmp_path, capsys):
    assert not t3.detect_environment().rocm  # the premise of this test: a CPU-only host
    model = fake_model(tmp_path, "tiny")  # nothing is loaded: only its files are read
    work = tmp_path / "work"
    report = evaluate(model, EvalOptions(tier="vllm", tasks=["gsm8k"], limit=50), work, FlagApprover())
    assert report.verdict == "unknown" and report.quantized == {}
    purposes = [c["purpose"] for c in report.deferred_commands]
    assert purposes[0].startswith("create the holder container") and any("serve" in p for p in purposes)
    printed = capsys.readouterr().err
    assert "vllm serve" in printed and "lm_eval --model local-completions" in printed  # a base model
    text = (work / "eval_report.md").read_text()
    assert "Deferred commands" in text and "--entrypoint sleep" in text and "flexible-extract" in text
    script = work / "tier3_deferred.sh"  # the same commands, runnable top to bottom (tests/test_tier3_script.py)
    assert f"`bash {script.resolve()}`" in text and script.stat().st_mode & 0o111
    assert "docker exec -d" in text and "wait until port 8080 is free" in text  # detached, stopped in between
    results = json.loads((work / "eval_results.json").read_text())
    assert results["deferred_commands"][0]["argv"][:3] == ["docker", "run", "-d"]


def _plan(tmp_path, env, runtime, **options):
    model = options.pop("model", None) or fake_model(tmp_path, "quant")
    opts = EvalOptions(tier="vllm", **options)
    models = [t3.ServedModel("quantized", model, "quantized")]
    if opts.baseline:
        models.append(t3.ServedModel("baseline", Path(opts.baseline), "baseline"))
    return t3.plan_commands(models, opts, tmp_path / "work", runtime, env, container="c1"), model


def test_docker_plan_holds_the_container_with_a_non_vllm_entrypoint(tmp_path):
    plan, model = _plan(tmp_path, ROCM_DOCKER, "docker", tasks=["arc_easy"], limit=20, num_fewshot=5)
    create, install = plan.setup
    argv = create.argv
    assert argv[:3] == ["docker", "run", "-d"] and argv[argv.index("--entrypoint") + 1] == "sleep"
    assert argv[-2:] == ["vllm/vllm-openai-rocm:latest", "infinity"]
    assert "--device=/dev/kfd" in argv and f"{model.resolve()}:{model.resolve()}:ro" in argv
    assert install.argv[:3] == ["docker", "exec", "c1"] and "lm-eval[api]" in install.argv
    serve, health, lm_eval = plan.per_model["quantized"]
    assert serve.background and serve.argv[:5] == ["docker", "exec", "c1", "sh", "-c"]
    inner = shlex.split(serve.argv[5].split("exec ", 1)[1])
    assert inner[:3] == ["vllm", "serve", str(model.resolve())] and "--port" in inner
    assert "/health" in health.argv[-1]
    assert lm_eval.argv[:4] == ["docker", "exec", "c1", "lm_eval"]
    assert lm_eval.argv[lm_eval.argv.index("--model") + 1] == "local-completions"  # loglikelihood task
    model_args = lm_eval.argv[lm_eval.argv.index("--model_args") + 1]
    assert "/v1/completions" in model_args and "max_length=40960" in model_args
    assert lm_eval.argv[lm_eval.argv.index("--num_fewshot") + 1] == "5"
    assert [c.argv for c in plan.teardown] == [["docker", "stop", "c1"], ["docker", "rm", "c1"]]
    assert argv[argv.index("--cidfile") + 1] == str(plan.container_id_file) and plan.container_id_file.name == "c1.cid"


def test_reasoning_chat_model_on_gsm8k_gets_chat_completions_and_a_big_budget(tmp_path):
    model = fake_model(tmp_path, "thinker", chat_template="{% if enable_thinking %}<think>{% endif %}")
    plan, _ = _plan(tmp_path, ROCM_DOCKER, "docker", model=model, tasks=["gsm8k"])
    lm_eval = plan.per_model["quantized"][2].argv
    assert (
        lm_eval[lm_eval.index("--model") + 1] == "local-chat-completions"
        and "--apply_chat_template" in lm_eval
    )
    assert "/v1/chat/completions" in lm_eval[lm_eval.index("--model_args") + 1]
    gen = lm_eval[lm_eval.index("--gen_kwargs") + 1]
    assert "max_gen_toks=32768" in gen and "temperature=0" in gen


def test_host_plan_runs_vllm_directly_and_reuse_skips_creation(tmp_path):
    host_env = t3.Environment(
        rocm=True,
        rocm_evidence=["torch.version.hip=6.2"],
        docker=False,
        in_container=True,
        vllm=True,
        lm_eval_api=True,
    )
    assert t3.choose_runtime(host_env, "auto") == "host"
    assert t3.choose_runtime(ROCM_DOCKER, "auto") == "docker"
    plan, model = _plan(tmp_path, host_env, "host", tasks=["gsm8k"])
    assert plan.setup == [] and plan.teardown == [] and plan.container is None
    serve, _, lm_eval = plan.per_model["quantized"]
    assert serve.argv[:3] == ["vllm", "serve", str(model.resolve())]
    assert lm_eval.argv[0] == "lm_eval" and "docker" not in lm_eval.argv
    reused, _ = _plan(tmp_path / "r", ROCM_DOCKER, "docker", vllm_container="mine", tasks=["gsm8k"])
    assert not reused.create_container and reused.teardown == []
    assert reused.setup[0].argv[:3] == ["docker", "exec", "mine"]


class FakeProcess:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeExecutor(t3.Executor):
    """Records every command; `lm_eval` writes results as the real one would."""

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        self.calls: list[list[str]] = []
        self.stopped: list[tuple] = []

    def run(self, argv, timeout=None, check=True):
        self.calls.append(argv)
        if "lm_eval" in argv:
            out = Path(argv[argv.index("--output_path") + 1]) / "served"
            out.mkdir(parents=True, exist_ok=True)
            score = 0.70 if "model=quantized" in argv[argv.index("--model_args") + 1] else 0.80
            (out / "results_2026.json").write_text(
                json.dumps(
                    {
                        "results": {
                            "gsm8k": {
                                "alias": "gsm8k",
                                "exact_match,flexible-extract": score,
                                "exact_match_stderr,flexible-extract": 0.01,
                            }
                        },
                        "higher_is_better": {"gsm8k": {"exact_match": True}},
                    }
                )
            )
        return "0123abcd\n" if argv[:2] == ["docker", "run"] else ""

    def start(self, argv, log_name):
        self.calls.append(argv)
        pid_file = self.workdir / log_name.replace(".log", ".pid")
        pid_file.write_text("4242\n")  # what the launcher inside the container writes
        return FakeProcess()

    def healthy(self, port):
        return True

    def port_free(self, port):
        self.calls.append(["port free?", str(port)])
        return True

    def stop_server(self, process, pid_file, container):
        self.calls.append(["stop", pid_file.name])
        self.stopped.append((pid_file.read_text().strip(), container))


def test_rocm_run_asks_first_then_stops_only_what_it_started(tmp_path):
    quant, base = fake_model(tmp_path, "q"), fake_model(tmp_path, "b")
    work = tmp_path / "work"
    work.mkdir()
    ctx = TierInputs(quant, EvalOptions(tier="vllm", tasks=["gsm8k"], baseline=base), work, FlagApprover())
    prepared = t3.prepare(ctx, env=ROCM_DOCKER)
    with pytest.raises(CheckpointPending):
        t3.score(prepared, FakeExecutor(work))
    ctx.approver = FlagApprover(["eval"])
    executor = FakeExecutor(work)
    outcome = t3.score(prepared, executor)
    assert outcome.quantized == {"gsm8k": {"exact_match,flexible-extract": 0.70}}
    assert outcome.baseline == {"gsm8k": {"exact_match,flexible-extract": 0.80}}
    assert executor.calls[0][:3] == ["docker", "run", "-d"]
    assert executor.calls[-2:] == [["docker", "stop", "0123abcd"], ["docker", "rm", "0123abcd"]]  # by id
    assert executor.stopped == [("4242", prepared.plan.container)] * 2  # each server by its pid
    order = [c[0] if c[0] in ("port free?", "stop") else c[2] if c[:2] == ["docker", "exec"] else c[1]
             for c in executor.calls]
    serves = [i for i, c in enumerate(executor.calls) if c[:5] == ["docker", "exec", prepared.plan.container, "sh", "-c"]]
    assert [order[i - 1] for i in serves] == ["port free?", "port free?"]  # each server after its port check
    assert order.index("stop") < serves[1]  # the quantized model's server stopped before the baseline's starts


class InterruptedCreate(FakeExecutor):
    """Ctrl-C while `docker run` starts the container: docker has recorded its id, the run never printed it."""

    def run(self, argv, timeout=None, check=True):
        if argv[:2] == ["docker", "run"]:
            self.calls.append(argv)
            Path(argv[argv.index("--cidfile") + 1]).write_text("feed5678")
            raise KeyboardInterrupt
        return super().run(argv, timeout, check)


def test_an_interrupt_inside_docker_run_still_removes_the_container_it_created(tmp_path):
    quant = fake_model(tmp_path, "q")
    work = tmp_path / "work"
    work.mkdir()
    ctx = TierInputs(quant, EvalOptions(tier="vllm", tasks=["gsm8k"]), work, FlagApprover(["eval"]))
    prepared = t3.prepare(ctx, env=ROCM_DOCKER)
    executor = InterruptedCreate(work)
    with pytest.raises(KeyboardInterrupt):
        t3.score(prepared, executor)
    assert executor.calls[-2:] == [["docker", "stop", "feed5678"], ["docker", "rm", "feed5678"]]
    assert not prepared.plan.container_id_file.exists()  # a rerun can record its own container


class HeldPort(FakeExecutor):
    """The port is held: by someone else's server from the start, or by ours for a while after its stop."""

    def __init__(self, workdir: Path, answers: list[bool]):
        super().__init__(workdir)
        self.answers = answers

    def port_free(self, port):
        self.calls.append(["port free?", str(port)])
        return self.answers.pop(0) if self.answers else True


def test_rocm_run_waits_for_the_port_and_never_checks_someone_elses_server(tmp_path):
    quant, base = fake_model(tmp_path, "q"), fake_model(tmp_path, "b")
    work = tmp_path / "work"
    work.mkdir()
    ctx = TierInputs(quant, EvalOptions(tier="vllm", tasks=["gsm8k"], baseline=base), work, FlagApprover(["eval"]))
    taken = HeldPort(work, [False])
    with pytest.raises(QpeError, match="Port 8080 is still in use, so the quantized model's vLLM server cannot start"):
        t3.score(t3.prepare(ctx, env=ROCM_DOCKER), taken)
    assert not any("vllm serve" in " ".join(c) for c in taken.calls)  # no server started
    assert taken.calls[-2:] == [["docker", "stop", "0123abcd"], ["docker", "rm", "0123abcd"]]  # its container removed
    slow = HeldPort(work, [True, False, True])  # the quantized server's port is released a second after its stop
    outcome = t3.score(t3.prepare(ctx, env=ROCM_DOCKER), slow)
    assert outcome.baseline == {"gsm8k": {"exact_match,flexible-extract": 0.80}}
    checks = [i for i, c in enumerate(slow.calls) if c[0] == "port free?"]
    assert len(checks) == 4 and checks[1] + 1 == checks[2]  # asked again before the baseline's server started
    assert slow.calls[checks[3] - 1][0] == "stop"  # and once the last server stopped: no port of ours left held


class SilentLmEval(FakeExecutor):
    """lm_eval that exits 0 but writes no results (a crash it swallowed, a wrong --output_path)."""

    def run(self, argv, timeout=None, check=True):
        if "lm_eval" in argv:
            self.calls.append(argv)
            return ""
        return super().run(argv, timeout, check)


def _stale_results(work: Path, label: str, score: float) -> Path:
    """A results file an earlier run left behind, newer-looking than anything this run writes."""
    import os
    import time

    old = work / "lm_eval_vllm" / label / "earlier" / "results_2025.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"results": {"gsm8k": {"exact_match,flexible-extract": score}},
                               "higher_is_better": {"gsm8k": {"exact_match": True}}}))
    future = time.time() + 3600
    os.utime(old, (future, future))
    return old


def test_tier3_reads_only_the_results_its_own_run_wrote(tmp_path):
    quant = fake_model(tmp_path, "q")
    work = tmp_path / "work"
    work.mkdir()
    _stale_results(work, "quantized", 0.11)
    ctx = TierInputs(quant, EvalOptions(tier="vllm", tasks=["gsm8k"]), work, FlagApprover(["eval"]))
    prepared = t3.prepare(ctx, env=ROCM_DOCKER)
    outcome = t3.score(prepared, FakeExecutor(work))
    assert outcome.quantized == {"gsm8k": {"exact_match,flexible-extract": 0.70}}  # not the stale 0.11
    # lm_eval wrote nothing this time: the stale file is not taken for this run's scores
    with pytest.raises(QpeError, match="no new results"):
        t3.score(t3.prepare(ctx, env=ROCM_DOCKER), SilentLmEval(work))


def test_tier3_serves_with_the_plans_tensor_parallelism_and_kv_cache_dtype(tmp_path, catalog, corpus):
    """The plan's serving fit (issue 15) sizes each server: an 8 B Llama in FP8 with an FP8 KV cache at
    128 k tokens x batch 8 needs two H100s; its BF16 baseline (weights and KV cache twice as big) four."""
    from quark_ptq_eval.intake import analyze_model
    from quark_ptq_eval.plan import PlanRequest, make_plan
    from tests.plan.test_plan_targets import LLAMA_8B, cpu_env, header_only_llama

    model = header_only_llama(tmp_path / "llama-8b", **LLAMA_8B)  # headers only: nothing is loaded
    analysis = analyze_model(str(model), offline=True, catalog=catalog)
    request = PlanRequest(goal="fp8 for H100 with 128k context, batch 8", calib_data=str(corpus))
    plan = make_plan(analysis, cpu_env(), request, catalog, tmp_path / "a.json", tmp_path / "out").to_dict()
    assert plan["kv_cache_scheme"] == "fp8" and plan["target"]["serving_fit"]["devices_needed"] == 2
    work = tmp_path / "work"
    ctx = TierInputs(model, EvalOptions(tier="vllm", tasks=["gsm8k"], baseline=model), work, FlagApprover(),
                      plan=plan)
    outcome = t3.score(t3.prepare(ctx, env=NO_ROCM))
    serve = {c["purpose"].split()[2]: shlex.split(c["argv"][-1].split("exec ", 1)[1])
             for c in outcome.deferred_commands if c["purpose"].startswith("serve")}
    q, b = serve["quantized"], serve["baseline"]
    assert q[q.index("--tensor-parallel-size") + 1] == "2" and q[q.index("--kv-cache-dtype") + 1] == "fp8"
    assert b[b.index("--tensor-parallel-size") + 1] == "4" and "--kv-cache-dtype" not in b
    assert q[q.index("--max-model-len") + 1] == b[b.index("--max-model-len") + 1] == "131072"  # the goal's context
    lm_eval = next(c["argv"] for c in outcome.deferred_commands if c["purpose"].startswith("evaluate the quantized"))
    assert "max_length=131072" in lm_eval[lm_eval.index("--model_args") + 1]
    script = Path(outcome.artifacts["Tier 3 script"]).read_text()
    assert "--tensor-parallel-size 2 --kv-cache-dtype fp8" in script and "--tensor-parallel-size 4" in script
    assert any("needs 2 x H100" in n and "131072 tokens x batch 8" in n for n in outcome.notes)

    unplanned = t3.prepare(TierInputs(model, EvalOptions(tier="vllm"), tmp_path / "w2", FlagApprover()), env=NO_ROCM)
    argv = unplanned.plan.per_model["quantized"][0].argv
    assert not {"--tensor-parallel-size", "--kv-cache-dtype", "--max-model-len"} & set(shlex.split(argv[-1]))
    assert any("No quantization plan" in n for n in unplanned.plan.notes)
