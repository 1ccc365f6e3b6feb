"""The real ``quark-cli torch-llm-ptq`` engine, offline on CPU, calibrating on local text.

The calibration dataset quark-cli insists on (``--dataset pileval`` =
``mit-han-lab/pile-val-backup``) is served from a private prepared `datasets` cache built
from the test corpus; the child gets it through its environment only. One real run through the
pipeline (``run --engine quark-cli``) is shared by the slow tests here.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.textdata import split_plain_text
from quark_ptq_eval.context import quark_cli
from quark_ptq_eval.plan.engines.calib_cache import (
    CALIBRATION_DATASETS,
    prepare_offline_calibration,
    read_documents,
)
from quark_ptq_eval.plan.engines.quark_cli import CALIB_CACHE_DIR

# A representative command's flags: each must exist in the installed quark-cli.
EMITTED_FLAGS = (
    "--model_dir", "--output_dir", "--device", "--multi_device", "--dataset", "--seq_len", "--batch_size",
    "--num_calib_data", "--quant_scheme", "--layer_quant_scheme", "--kv_cache_dtype", "--quant_algo",
    "--exclude_layers", "--skip_evaluation", "--no_trust_remote_code",
)
WEIGHT_ONLY_SCHEME = "int4_wo_128"  # weight-only: the CPU path quark-cli supports with --multi_device


def quark_dir() -> Path:
    # find_spec of a top-level package locates it without importing it (import costs ~25 s).
    spec = importlib.util.find_spec("quark")
    assert spec and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def load_offline(cache_env: dict[str, str], calls: dict[str, str]) -> dict[str, list[str]]:
    """Run ``datasets.load_dataset`` calls in a fresh interpreter with ``cache_env`` (datasets reads env at import)."""
    code = (
        "import datasets, json, sys\n"
        "out = {}\n"
        "for key, (args, kwargs, column) in json.loads(sys.argv[1]).items():\n"
        "    out[key] = list(datasets.load_dataset(*args, **kwargs)[column])\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HOME": cache_env["HF_DATASETS_CACHE"] + "-no-hf-home", **cache_env}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_call(name: str) -> tuple[list[str], dict[str, str], str]:
    """The exact ``load_dataset`` call quark's data_preparation.py makes for ``--dataset name``."""
    spec = CALIBRATION_DATASETS[name]
    args = [spec.repo_id] + ([spec.config] if spec.config else [])
    return args, {"split": spec.split}, spec.column


# ---------------------------------------------------------------- fast: cache builder


def test_registry_matches_installed_quark_sources():
    """Our dataset registry is data; hold it against the installed Quark's loader source."""
    source = (quark_dir() / "torch/utils/llm/data_preparation.py").read_text(encoding="utf-8")
    cli = (quark_dir() / "experimental/cli/torch_llm_ptq.py").read_text(encoding="utf-8")
    for name, spec in CALIBRATION_DATASETS.items():
        assert f'"{name}"' in cli, f"--dataset {name} no longer offered by quark-cli"
        assert f'load_dataset("{spec.repo_id}"' in source
        assert f'split="{spec.split}"' in source
        if spec.config:
            assert f'"{spec.config}"' in source
        assert f'"{spec.column}"' in source


def test_plain_text_is_split_into_documents():
    assert split_plain_text("a b\nc d\n\n\nsecond para\n  \nthird") == ["a b\nc d", "second para", "third"]
    assert split_plain_text("one\ntwo\n\n") == ["one", "two"]


def test_prepared_cache_resolves_offline_with_the_right_texts(tmp_path, corpus):
    cache = tmp_path / "calib-cache"
    env = prepare_offline_calibration(corpus, cache, "pileval")
    prepare_offline_calibration(corpus, cache, "wikitext")
    prepare_offline_calibration(corpus, cache, "cnn_dailymail")
    assert env["HF_DATASETS_CACHE"] == str(cache.resolve())
    assert env["HF_DATASETS_OFFLINE"] == env["HF_HUB_OFFLINE"] == "1"
    expected = [line.strip() for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]

    loaded = load_offline(env, {name: load_call(name) for name in ("pileval", "wikitext", "cnn_dailymail")})

    for name, texts in loaded.items():
        assert texts == expected, name


def test_cache_is_reused_for_the_same_text_and_replaced_for_new_text(tmp_path, corpus):
    cache = tmp_path / "calib-cache"
    prepare_offline_calibration(corpus, cache)
    entries = list(cache.glob("mit-han-lab___pile-val-backup/default/0.0.0/*/pile-val-backup-validation.arrow"))
    assert len(entries) == 1
    stamp = entries[0].stat().st_mtime_ns
    prepare_offline_calibration(corpus, cache)
    assert entries[0].stat().st_mtime_ns == stamp  # reused, not rewritten

    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"text": f"document {i}"}) for i in range(5)) + "\n", encoding="utf-8")
    env = prepare_offline_calibration(other, cache)
    now = list(cache.glob("mit-han-lab___pile-val-backup/*/*/*/dataset_info.json"))
    assert len(now) == 1 and now[0].parent != entries[0].parent  # only the new text can be picked
    assert load_offline(env, {"p": load_call("pileval")})["p"] == [f"document {i}" for i in range(5)]


def test_bad_calibration_input_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    with pytest.raises(UsageError, match="holds no text"):
        read_documents(empty)
    with pytest.raises(UsageError, match="cannot be served"):
        prepare_offline_calibration(empty, tmp_path / "c", dataset="HuggingFaceH4/ultrachat_200k")
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------- fast: quark-cli flags


def test_help_parser_reads_the_option_column_only():
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--model_dir", required=True, help="mentions --not_a_flag in prose")
    parser.add_argument("--kv_cache_dtype", "--kv_cache_quant_scheme", choices=["fp8", "mxfp4"])
    parser.add_argument("--layer_quant_scheme", nargs=2, metavar=("PATTERN", "SCHEME"))
    parser.add_argument("--a_very_long_flag_name_that_wraps_its_help", action="store_true", help="h")
    flags = quark_cli.parse_help_flags(parser.format_help())
    assert flags == {"-h", "--help", "--model_dir", "--kv_cache_dtype", "--kv_cache_quant_scheme",
                     "--layer_quant_scheme", "--a_very_long_flag_name_that_wraps_its_help"}


def test_every_emitted_flag_exists_in_installed_quark_cli(monkeypatch):
    # the product's cache, the session's (conftest: QUARK_PTQ_EVAL_CACHE under .pytest_cache), shared with the
    # manifest and newcomer tests: the ~45 s `--help` is paid once per Quark version, by whichever asks first
    cache_dir = quark_cli.default_cache_dir()
    flags = quark_cli.quark_cli_flags(cache_dir)
    missing = [f for f in EMITTED_FLAGS if f not in flags]
    assert not missing, f"installed quark-cli lacks {missing}"

    quark_cli._flags_for.cache_clear()
    monkeypatch.setattr(quark_cli, "_run_help", lambda: pytest.fail("the on-disk cache was not used"))
    assert quark_cli.quark_cli_flags(cache_dir) == flags


def test_two_callers_that_miss_the_flag_cache_at_once_run_one_help(tmp_path, monkeypatch):
    """`--help` costs ~45 s: the first caller runs it under the cache's lock, the other waits and reads its file."""
    import threading

    calls = []

    def slow_help() -> str:
        calls.append(1)
        time.sleep(0.5)
        return "  --model_dir MODEL_DIR   the model\n  -h, --help  show this help"

    monkeypatch.setattr(quark_cli, "_run_help", slow_help)
    quark_cli._flags_for.cache_clear()
    got: list[set[str]] = []
    threads = [threading.Thread(target=lambda: got.append(quark_cli.quark_cli_flags(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    quark_cli._flags_for.cache_clear()
    assert len(calls) == 1 and got == [{"--model_dir", "-h", "--help"}] * 2


# ---------------------------------------------------------------- slow: the real engine


def tree_digest(root: Path, skip_dirs: tuple[str, ...] = ()) -> str:
    """Checksum of every file's path, size and mtime under ``root`` ("" when absent)."""
    if not root.exists():
        return ""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        for name in sorted(filenames):
            path = Path(dirpath, name)
            st = path.lstat()
            digest.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def user_hf_home(root: Path) -> Path:
    """A stand-in for the user's own ~/.cache/huggingface, with content that must stay as it is."""
    (root / "hub").mkdir(parents=True)
    (root / "hub" / "version.txt").write_text("1", encoding="utf-8")
    (root / "datasets").mkdir()
    (root / "datasets" / "marker.txt").write_text("user data", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, cli, tiny_llama, corpus):
    """One real ``run --engine quark-cli`` (weight-only + --multi-device, on CPU, calibrating offline on our
    text); record its output and the digests of what it must not touch."""
    tmp = tmp_path_factory.mktemp("quark-cli")
    hf_home, package = user_hf_home(tmp / "user-hf-home"), quark_dir()
    before = (tree_digest(hf_home), tree_digest(package, skip_dirs=("__pycache__",)))
    wd, out = tmp / "work", tmp / "out"
    started = time.monotonic()
    res = cli("run", tiny_llama, "-o", out, "--workdir", wd, "--calib-data", corpus, "--num-calib-samples", "8",
              "--calib-seq-len", "64", "--offline", "--scheme", WEIGHT_ONLY_SCHEME, "--engine", "quark-cli",
              "--multi-device", "--yes", "--eval-tier", "skip", "--json", cwd=tmp, env={"HF_HOME": str(hf_home)})
    engine_log = wd / "logs" / "engine.log"
    log = (engine_log.read_text(encoding="utf-8") if engine_log.is_file() else "") + res.err
    return {"rc": res.rc, "res": res, "log": log, "out": out, "wd": wd, "cache": (wd / CALIB_CACHE_DIR).resolve(),
            "hf_home": hf_home, "package": package, "before": before, "seconds": time.monotonic() - started,
            "after": (tree_digest(hf_home), tree_digest(package, skip_dirs=("__pycache__",)))}


@pytest.mark.slow
def test_real_quark_cli_quantizes_on_cpu_with_private_calibration_cache(cli_run):
    assert cli_run["rc"] == 0, cli_run["log"][-4000:]
    # datasets resolved quark-cli's fixed Hub id from our private cache, nowhere else.
    assert f"Found the latest cached dataset configuration 'default' at {cli_run['cache']}" in cli_run["log"]
    out = cli_run["out"]
    assert list(out.glob("*.safetensors"))
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    weight = config["quantization_config"]["global_quant_config"]["weight"]
    assert (weight["dtype"], weight["group_size"]) == ("int4", 128)
    assert (out / "tokenizer_config.json").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_the_pipeline_runs_quark_cli_validates_its_export_and_writes_the_card(cli_run):
    wd, out = cli_run["wd"], cli_run["out"]
    assert cli_run["rc"] == 0, cli_run["res"].err[-3000:]
    manifest = (wd / "run_manifest.yaml").read_text()
    assert "torch-llm-ptq" in manifest and "HF_DATASETS_CACHE" in manifest
    assert json.loads(cli_run["res"].out)["validation"] in ("success", "partial")
    assert (out / "model.safetensors").exists()
    # the source's README.md is the base model's card: never re-copied as a fix; the export's is our card
    report = json.loads((wd / "validation_report.json").read_text())
    assert not any("README.md" in str(fix) for fix in report.get("applied_fixes", [])), report.get("applied_fixes")
    assert "quark-ptq-eval" in (out / "README.md").read_text() and "int4_wo_128" in (out / "README.md").read_text()


@pytest.mark.slow
def test_quark_cli_output_reloads_with_finite_logits(cli_run, tiny_llama):
    assert cli_run["rc"] == 0, cli_run["log"][-4000:]
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(cli_run["out"])
    ids = tokenizer("Return a new dictionary initialized from an optional mapping.", return_tensors="pt").input_ids
    quantized = transformers.AutoModelForCausalLM.from_pretrained(cli_run["out"])
    source = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        q_loss = quantized(ids, labels=ids).loss
        s_loss = source(ids, labels=ids).loss
        assert torch.isfinite(quantized(ids).logits).all()
    assert abs(q_loss.item() - s_loss.item()) < 0.5  # int4 weights: close to, not equal to, the source


@pytest.mark.slow
def test_quark_cli_leaves_user_cache_and_quark_package_untouched(cli_run):
    assert cli_run["rc"] == 0, cli_run["log"][-4000:]
    assert cli_run["after"][0] == cli_run["before"][0], "the user's HF cache changed"
    assert cli_run["after"][1] == cli_run["before"][1], "a file in Quark's package changed"
    # quark-cli chdirs into its package folder: with absolute paths nothing may land there.
    workdir = cli_run["package"] / "experimental" / "cli" / "torch_llm"
    assert not [p for p in workdir.rglob("*") if p.is_file()]
