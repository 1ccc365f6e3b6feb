"""Issue 41: `--budget-bits B --formats a,b` plans the best per-group mix, from real scans of the model.

One real search on the trained tiny Llama (two scans: int4_wo_32 and int8); the budget's effective bits
are recomputed from the plan as Quark applies it, and the size model is held against a real export's
header. Budgets no mix can meet, and combinations the search cannot honour, are refused before anything
is measured (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quark_ptq_eval.base.safetensors_io import read_model_headers
from quark_ptq_eval.base.schemes import load_scheme_table
from quark_ptq_eval.plan.budget import linear_bytes
from quark_ptq_eval.plan.groups import scheme_of
from quark_ptq_eval.plan.scheme_fit import linear_shapes

FORMATS = "int4_wo_32,int8"


def _plan(cli, model: Path, root: Path, corpus: Path, *extra: str):
    wd = root / "wd"
    res = cli("plan", model, "-o", root / "out", "--workdir", wd, "--calib-data", corpus, "--offline",
              "--approve", "intake", *extra)
    return res, wd


@pytest.mark.parametrize("extra, says", [
    (("--budget-bits", "4", "--formats", FORMATS), "No mix of int4_wo_32, int8 fits 4 effective bits"),
    (("--budget-bits", "6", "--formats", "int8"), "--formats needs at least two formats"),
    (("--budget-bits", "6", "--formats", "int4_wo_32,int3"), "does not support the format(s) int3"),
    (("--budget-bits", "6", "--layer-quant-scheme", "*mlp*", "int8"), "cannot be combined with --layer-quant-scheme"),
])
def test_what_the_search_cannot_do_is_refused_before_anything_is_measured(cli, tiny_llama, corpus, tmp_path,
                                                                          extra, says):
    res, wd = _plan(cli, tiny_llama, tmp_path, corpus, *extra)
    assert res.rc == 2 and says in res.err and "Traceback" not in res.err, res.err[-1500:]
    assert "sensitivity:" not in res.out + res.err and not (wd / "search_report.json").exists()


def test_the_plan_mixes_both_formats_within_the_budget(cli, tiny_llama, corpus, tmp_path):
    res, wd = _plan(cli, tiny_llama, tmp_path, corpus, "--budget-bits", "6", "--formats", FORMATS)
    assert res.rc == 0, res.err[-3000:]
    plan = json.loads((wd / "quant_plan.json").read_text())
    table = load_scheme_table()["schemes"]
    shapes = linear_shapes(str(tiny_llama), plan["exclude_layers"])
    given = {n: scheme_of(n, plan["global_scheme"], plan["layer_quant_config"], plan["exclude_layers"]) for n in shapes}
    assert set(given.values()) == {"int4_wo_32", "int8"}  # both formats, every linear quantized
    bits = 8 * sum(linear_bytes(table[given[n]]["weight"], r, c, 4) for n, (r, c) in shapes.items()) \
        / sum(r * c for r, c in shapes.values())  # the tiny model is F32: F32 scales
    row = next(d for d in plan["decisions"] if d["decision"] == "budget search")
    assert bits <= 6 and bits == pytest.approx(row["effective_bits"], abs=1e-3)
    assert row["lp_bound"] <= row["predicted_kl"]
    report = json.loads((wd / "search_report.json").read_text())
    front = report["front"]
    assert [p["predicted_kl"] for p in front] == sorted((p["predicted_kl"] for p in front), reverse=True)
    assert front[0]["groups_per_format"]["int8"] == 0 and report["chosen"]["predicted_kl"] < front[0]["predicted_kl"]
    assert set(report["additivity"]) == {"int4_wo_32", "int8"}
    assert "## Predicted front" in (wd / "search_report.md").read_text()
    assert (wd / "search_report.png").read_bytes()[:4] == b"\x89PNG"


def test_the_size_model_matches_a_real_export(quantized, tiny_llama):
    """int4_wo_32 on the F32 tiny model: packed int4 weights, an F32 scale and a packed int4 zero point per 32."""
    out = read_model_headers(str(quantized("int4_wo_32")))
    spec = load_scheme_table()["schemes"]["int4_wo_32"]["weight"]
    for name, (rows, cols) in linear_shapes(str(tiny_llama), ["lm_head"]).items():
        written = sum(i.nbytes for t, i in out.items() if t.rpartition(".")[0] == name)
        assert written == linear_bytes(spec, rows, cols, 4), name


def test_an_moe_layers_experts_are_one_search_group_and_the_mix_names_them_by_layer():
    """Scan rows as the scan writes them for an MoE (one unit per layer's routed experts): the search decides each
    layer's experts together, fused q/k/v and gate/up together, and the mix's patterns never split either."""
    from quark_ptq_eval.flows.budget_search import mix_config, search_groups
    from quark_ptq_eval.plan.budget import solve
    from quark_ptq_eval.plan.groups import settle_groups

    shapes = {}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{x}_proj": (128, 128) for x in "qkvo"}
        shapes |= {p + f"mlp.experts.{e}.{x}_proj": ((64, 128) if x != "down" else (128, 64))
                   for e in range(4) for x in ("gate", "up", "down")}
    rows = [{"layer": n, "kl": 1e-4, "params": 128 * 128, "pattern": n} for n in shapes if ".experts." not in n]
    rows += [{"layer": f"model.layers.{i}.mlp.experts", "kl": 1e-3 * (i + 1), "params": 12 * 64 * 128,
              "pattern": f"model.layers.{i}.mlp.experts.*", "kind": "routed_experts"} for i in range(2)]
    scans = {"int4_wo_32": {"layers": rows}, "int8": {"layers": [dict(r, kl=r["kl"] / 10) for r in rows]}}
    groups, members = search_groups(shapes, scans, ["int4_wo_32", "int8"])
    names = {g.name for g in groups}
    assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts", "model.layers.0.self_attn.qkv_proj"} <= names
    assert len(groups) == 6  # per layer: q/k/v, o, the experts
    experts = next(g for g in groups if g.name == "model.layers.1.mlp.experts")
    assert experts.params == 12 * 64 * 128 and experts.kl == {"int4_wo_32": 2e-3, "int8": 2e-4}
    mix = solve(groups, ["int4_wo_32", "int8"], 6.0)
    scheme, overrides = mix_config(mix, groups, members, list(shapes))
    assert mix.choice["model.layers.1.mlp.experts"] == "int8"  # the most sensitive group gets the bits
    assert settle_groups(list(shapes), scheme, overrides, [], widen=False).widened == []  # nothing split
