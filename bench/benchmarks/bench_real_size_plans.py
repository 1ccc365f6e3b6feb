"""Plans at real size, from sparse real-shape checkpoints (no disk cost, no model weights).

Each case writes a checkpoint with the published model's tensor names, shapes, dtypes and (for FP8
releases) block scales, in its real number of shards, with every data region left as a hole
(``truncate``: a valid safetensors file whose payload reads as zeros). Then intake and plan run on
it in a child process, as the CLI would, for the named target. Printed per case: the plan's output
size next to an independent count from the headers (every quantized tensor at the scheme's bits
plus its scales, the rest in BF16 once read), the serving fit, the engine and host the plan
proposes, and intake + plan wall time and peak RSS. Figures go to docs/planning.md.

    .venv/bin/python -m bench.benchmarks.bench_real_size_plans [--work DIR] [--case NAME]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BF16, F8, F32 = "BF16", "F8_E4M3", "F32"
DTYPE_BYTES = {BF16: 2, F8: 1, F32: 4}
BLOCK = 128


# ---- the published shapes ------------------------------------------------------------------------
def deepseek_v3() -> tuple[dict, list[tuple[str, str, list[int]]], int]:
    """DeepSeek-V3 / R1 as released (FP8 blocks, 61 layers + the MTP layer 61, 163 shards)."""
    return mla_moe(experts=256, heads=128, vocab=129280, dense=3, mtp=True, fp8_blocks=True, shards=163)


def mla_moe(experts: int, heads: int, vocab: int, dense: int, mtp: bool, fp8_blocks: bool,
            shards: int) -> tuple[dict, list[tuple[str, str, list[int]]], int]:
    """DeepSeek-V3's architecture (MLA + MoE, 61 layers, hidden 7168, experts of 2048): its releases
    (``fp8_blocks``: FP8 linears with 128x128 block scales) and its relatives (Kimi-K2, in BF16)."""
    h, inter, moe = 7168, 18432, 2048
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": h,
              "intermediate_size": inter, "moe_intermediate_size": moe, "n_routed_experts": experts,
              "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": dense, "num_hidden_layers": 61,
              "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": 1536, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": vocab,
              "num_nextn_predict_layers": int(mtp), "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if fp8_blocks:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [BLOCK, BLOCK]}
    t: list[tuple[str, str, list[int]]] = [("model.embed_tokens.weight", BF16, [vocab, h])]

    def fp8(name: str, out: int, inp: int) -> None:
        if not fp8_blocks:
            t.append((f"{name}.weight", BF16, [out, inp]))
            return
        t.append((f"{name}.weight", F8, [out, inp]))
        t.append((f"{name}.weight_scale_inv", F32, [math.ceil(out / BLOCK), math.ceil(inp / BLOCK)]))

    def mlp(p: str, i: int) -> None:
        fp8(f"{p}.gate_proj", i, h), fp8(f"{p}.up_proj", i, h), fp8(f"{p}.down_proj", h, i)

    for n in range(61 + int(mtp)):
        p = f"model.layers.{n}"
        t += [(f"{p}.input_layernorm.weight", BF16, [h]), (f"{p}.post_attention_layernorm.weight", BF16, [h]),
              (f"{p}.self_attn.q_a_layernorm.weight", BF16, [1536]),
              (f"{p}.self_attn.kv_a_layernorm.weight", BF16, [512])]
        fp8(f"{p}.self_attn.q_a_proj", 1536, h), fp8(f"{p}.self_attn.q_b_proj", heads * 192, 1536)
        fp8(f"{p}.self_attn.kv_a_proj_with_mqa", 576, h), fp8(f"{p}.self_attn.kv_b_proj", heads * 256, 512)
        fp8(f"{p}.self_attn.o_proj", h, heads * 128)
        if n < dense:
            mlp(f"{p}.mlp", inter)
            continue
        t += [(f"{p}.mlp.gate.weight", BF16, [experts, h]), (f"{p}.mlp.gate.e_score_correction_bias", F32, [experts])]
        for e in range(experts):
            mlp(f"{p}.mlp.experts.{e}", moe)
        mlp(f"{p}.mlp.shared_experts", moe)
    if mtp:
        m = "model.layers.61"  # the multi-token-prediction module the release ships with layer 61
        t += [(f"{m}.embed_tokens.weight", BF16, [vocab, h]), (f"{m}.enorm.weight", BF16, [h]),
              (f"{m}.hnorm.weight", BF16, [h]), (f"{m}.shared_head.norm.weight", BF16, [h]),
              (f"{m}.shared_head.head.weight", BF16, [vocab, h])]
        fp8(f"{m}.eh_proj", h, 2 * h)
    t += [("model.norm.weight", BF16, [h]), ("lm_head.weight", BF16, [vocab, h])]
    return config, t, shards


def llama_405b() -> tuple[dict, list[tuple[str, str, list[int]]], int]:
    """Llama-3.1-405B (BF16, 126 layers, 191 shards)."""
    h, inter, vocab, heads, kv, hd = 16384, 53248, 128256, 128, 8, 128
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": inter,
              "num_hidden_layers": 126, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    t = [("model.embed_tokens.weight", BF16, [vocab, h])]
    for n in range(126):
        p = f"model.layers.{n}"
        t += [(f"{p}.input_layernorm.weight", BF16, [h]), (f"{p}.post_attention_layernorm.weight", BF16, [h]),
              (f"{p}.self_attn.q_proj.weight", BF16, [heads * hd, h]), (f"{p}.self_attn.k_proj.weight", BF16, [kv * hd, h]),
              (f"{p}.self_attn.v_proj.weight", BF16, [kv * hd, h]), (f"{p}.self_attn.o_proj.weight", BF16, [h, heads * hd]),
              (f"{p}.mlp.gate_proj.weight", BF16, [inter, h]), (f"{p}.mlp.up_proj.weight", BF16, [inter, h]),
              (f"{p}.mlp.down_proj.weight", BF16, [h, inter])]
    t += [("model.norm.weight", BF16, [h]), ("lm_head.weight", BF16, [vocab, h])]
    return config, t, 191


def qwen3_235b() -> tuple[dict, list[tuple[str, str, list[int]]], int]:
    """Qwen3-235B-A22B (BF16, 94 layers of 128 experts, 118 shards)."""
    h, moe, experts, vocab, heads, kv, hd = 4096, 1536, 128, 151936, 64, 4, 128
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": h,
              "intermediate_size": 12288, "moe_intermediate_size": moe, "num_experts": experts,
              "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16"}
    t = [("model.embed_tokens.weight", BF16, [vocab, h])]
    for n in range(94):
        p = f"model.layers.{n}"
        t += [(f"{p}.input_layernorm.weight", BF16, [h]), (f"{p}.post_attention_layernorm.weight", BF16, [h]),
              (f"{p}.self_attn.q_norm.weight", BF16, [hd]), (f"{p}.self_attn.k_norm.weight", BF16, [hd]),
              (f"{p}.self_attn.q_proj.weight", BF16, [heads * hd, h]), (f"{p}.self_attn.k_proj.weight", BF16, [kv * hd, h]),
              (f"{p}.self_attn.v_proj.weight", BF16, [kv * hd, h]), (f"{p}.self_attn.o_proj.weight", BF16, [h, heads * hd]),
              (f"{p}.mlp.gate.weight", BF16, [experts, h])]
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            t += [(f"{q}.gate_proj.weight", BF16, [moe, h]), (f"{q}.up_proj.weight", BF16, [moe, h]),
                  (f"{q}.down_proj.weight", BF16, [h, moe])]
    t += [("model.norm.weight", BF16, [h]), ("lm_head.weight", BF16, [vocab, h])]
    return config, t, 118


CASES = {  # name -> (shapes, scheme, target)
    "deepseek-v3-fp8-mxfp4-mi355x": (deepseek_v3, "mxfp4", "mi355x"),
    "llama-3.1-405b-fp8-mi300x": (llama_405b, "fp8", "mi300x"),
    "qwen3-235b-a22b-mxfp4-mi355x": (qwen3_235b, "mxfp4", "mi355x"),
}


# ---- the sparse checkpoint -----------------------------------------------------------------------
def nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


def write_sparse(out: Path, config: dict, tensors: list[tuple[str, str, list[int]]], shards: int) -> None:
    """Real names, shapes and dtypes in ``shards`` files of about equal size; payloads are holes."""
    out.mkdir(parents=True, exist_ok=True)
    total = sum(nbytes(d, s) for _, d, s in tensors)
    per, groups, cur, size = total / shards, [], [], 0
    for item in tensors:
        cur.append(item)
        size += nbytes(item[1], item[2])
        if size >= per * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {}, 0
        for tname, dtype, shape in group:
            header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes(dtype, shape)]}
            offset += nbytes(dtype, shape)
            weight_map[tname] = name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / name, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)  # the data region: a hole
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))


# ---- the independent count -----------------------------------------------------------------------
SCHEME_BITS = {"mxfp4": (4, 8 / 32), "fp8": (8, 0.0), "ptpc_fp8": (8, 0.0)}  # weight bits, scale bits per weight


def header_count(tensors: list[tuple[str, str, list[int]]], scheme: str, excludes: list[str]) -> int:
    """Output bytes by counting: each template linear at the scheme's bits + scales, the rest in BF16."""
    bits, scale_bits = SCHEME_BITS[scheme]
    total = 0
    for name, dtype, shape in tensors:
        if name.endswith(("_scale_inv",)):
            continue  # consumed when the FP8 source is read
        module = name.rpartition(".")[0]
        linear = (name.endswith(".weight") and len(shape) == 2 and "embed" not in name and "norm" not in name
                  and not any(fnmatch.fnmatchcase(module, p) for p in excludes))
        n = math.prod(shape)
        if linear:
            total += n * (bits + scale_bits) / 8 + (4 * shape[0] if scheme == "ptpc_fp8" else 4 if scheme == "fp8" else 0)
        else:
            total += n * (DTYPE_BYTES[dtype] if dtype != F8 else 2)
    return int(total)


# ---- intake + plan in a child (its wall time and peak RSS are the figures) -------------------------
def child(model: str, work: str, scheme: str, target: str) -> None:
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.context.preflight import detect_env
    from quark_ptq_eval.flows import api
    from quark_ptq_eval.intake import analyze_model

    catalog = load_catalog()
    t0 = time.perf_counter()
    analysis = analyze_model(model, offline=True, catalog=catalog)
    analysis.write(work)
    env = detect_env()
    plan = api.plan_quantization(analysis, Path(work) / "out", env_context=env, workdir=work, scheme=scheme,
                                 target=target, num_calib_samples=32, calib_seq_len=512, offline=False)
    seconds = time.perf_counter() - t0
    res, fit = plan.resources, plan.target.get("serving_fit") or {}
    print(json.dumps({
        "seconds": round(seconds, 2), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "params": analysis.size.get("params"), "format": analysis.source_format.get("name"),
        "excludes": analysis.template["exclude_layers"], "output_bytes": res["output_bytes"],
        "serving": f"{fit.get('devices_needed')} x {target}", "engine": plan.engine["name"],
        "engine_reason": plan.engine["reason"], "reading": plan.source_reading.get("mode"),
        "reading_reason": plan.source_reading.get("reason"), "fits_here": res["fits"],
        "engine_peak": {"host": res["quantize"]["host_peak_bytes"], "gpu": res["quantize"]["gpu_peak_bytes"]},
        "blocking": [p["message"] for p in res["problems"] if p["blocking"]],
        "proposals": [p["detail"] for p in res["proposals"]]}))


def run_case(name: str, work: Path) -> dict:
    shapes, scheme, target = CASES[name]
    config, tensors, shards = shapes()
    model = work / name
    t0 = time.perf_counter()
    write_sparse(model, config, tensors, shards)
    built = time.perf_counter() - t0
    wd = work / f"{name}-work"
    wd.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, __file__, "--child", str(model), str(wd), scheme, target],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{name}: intake/plan failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    count = header_count(tensors, scheme, got["excludes"])
    got.update(case=name, shards=shards, tensors=len(tensors), build_seconds=round(built, 1), header_count=count,
               ratio=round(got["output_bytes"] / count, 3))
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--case", choices=sorted(CASES), action="append")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    work = args.work or Path(tempfile.mkdtemp(prefix="real-size-plans-"))
    for name in args.case or CASES:
        r = run_case(name, work)
        gb = 1e9
        print(f"{r['case']}: {r['tensors']} tensors in {r['shards']} shards, {r['params'] / 1e9:.1f} B params "
              f"({r['format']})\n  output {r['output_bytes'] / gb:.1f} GB vs header count {r['header_count'] / gb:.1f} GB "
              f"(ratio {r['ratio']})\n  serving fit: {r['serving']}\n  engine: {r['engine']} ({r['engine_reason']})\n"
              f"  source reading: {r['reading']}\n  engine peak: host {r['engine_peak']['host'] / 2**30:.0f} GiB, "
              f"GPU {r['engine_peak']['gpu'] / 2**30:.0f} GiB; fits this host: {r['fits_here']}"
              f"{''.join(' (' + m + ')' for m in r['blocking'])}\n"
              f"  proposals: {' | '.join(r['proposals']) or '-'}\n"
              f"  intake + plan: {r['seconds']} s, peak RSS {r['peak_rss_mib']} MiB (sparse build {r['build_seconds']} s)")


if __name__ == "__main__":
    main()
