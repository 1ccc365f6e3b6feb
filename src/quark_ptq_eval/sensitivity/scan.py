"""Measure, unit by unit, how much quantizing that unit alone moves the next-token distribution.

The model is the one the engine quantizes: the same ``prepare_for_quantization`` (MoE experts
split per expert), the same template config (exclusions, per-layer overrides). One Quark
quantization of the whole model (fake-quant, Quark's own ``ModelQuantizer`` and calibration), then
every quantizer is switched off, and each unit (a layer, or an MoE layer's experts: units.py) is
switched back on alone for one measurement: KL(unquantized || this-unit-quantized) per token,
averaged over a small calibration slice. A unit in block b replays only blocks b.. on inputs
cached by the reference pass (see replay.py), so the scan costs one calibration plus about U/2
model passes for U units.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.options import flag
from quark_ptq_eval.evaluate.ppl.baseline_cache import (
    model_digest,  # one digest of a model's weights (config + shards)
)
from quark_ptq_eval.sensitivity.cache import METHOD_VERSION, ScanCache, scan_key, tokens_digest
from quark_ptq_eval.sensitivity.replay import Decoder, capture_inputs, find_decoder, replay, replay_matches
from quark_ptq_eval.sensitivity.units import EXPERT_UNITS, Routing, ScanUnit, measurement_units, module_type

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ESTIMATE_AFTER = 2  # layers timed before the whole scan's time is estimated
Progress = Callable[[str], None]


@dataclass
class ScanOptions:
    """What a scan measures; the fields with a flag are the `sensitivity` command's options."""

    model_dir: Path  # the command's positional MODEL
    scheme: str = field(metadata=flag("--scheme", required=True,
                                      help="exact Quark scheme name (int4_wo_32, mxfp4, fp8, ...)"))
    calib_data: Path = field(metadata=flag(  # the command defaults it to the demo corpus
        "--calib-data", type=Path,
        help="local calibration text: .txt, .jsonl or .parquet (default: the demo corpus, built on the spot)"))
    num_samples: int = field(default=8, metadata=flag(
        "--num-calib-samples", type=int, help="token windows measured (default 8)"))
    seq_len: int = field(default=128, metadata=flag("--calib-seq-len", type=int, help="tokens per window (default 128)"))
    exclude: list[str] | None = field(default=None, metadata=flag(  # None: the Quark template's defaults
        "--exclude", nargs="*", metavar="PATTERN",
        help="layers the plan keeps unquantized anyway (default: Quark's template exclusions)"))
    device: str = field(default="cpu", metadata=flag("--device", help="cpu (default) or cuda"))
    trust_remote_code: bool = field(default=False, metadata=flag("--trust-remote-code", action="store_true"))
    estimate_only: bool = field(default=False, metadata=flag(  # time the first layers, persist them, stop
        "--estimate-only", action="store_true",
        help="time the first layers, keep them, print the estimate for the rest and stop"))
    cache_root: Path | None = None
    use_cache: bool = field(default=True, metadata=flag(
        "--no-cache", action="store_false", help="measure again even when a cached scan matches"))
    replay: bool = True  # False: full forward passes for every measurement (the benchmark's comparison)
    layer_config: dict[str, str] | None = None  # per-layer scheme overrides (Quark's layer_quant_config)
    expert_units: str = field(default="group", metadata=flag(
        "--expert-units", choices=list(EXPERT_UNITS),
        help="MoE experts measured as one group per layer (default), per expert, or per projection type "
             "(gate/up/down across the layer's experts)"))


@dataclass
class Session:
    """The loaded model, quantized once in fake-quant mode, and what the measurements need."""

    model: Any
    batches: list[Any]
    reference: list[Any]  # float32 log-probs per batch, nothing quantized
    layers: dict[str, Any]  # quantized module name -> its Quark quantizers
    decoder: Decoder | None  # None: measure with full forward passes
    units: dict[str, ScanUnit] = field(default_factory=dict)  # what is measured alone (units.py)
    routing: Routing = field(default_factory=Routing)  # MoE routing of the reference pass
    share: dict[str, Any] = field(default_factory=dict)  # quantized share of matrix parameters
    saved: dict[int, tuple[bool, bool]] = field(default_factory=dict)  # quantizer id -> (fake_quant, observer)
    passes: float = 0.0  # model passes spent in measurements (a replay of k of N blocks counts k/N)


@dataclass(frozen=True)
class UnitKL:
    """One scan unit as read outside the scan: its name, its KL quantized alone, the pattern naming its linears."""

    layer: str
    kl: float
    pattern: str


@dataclass(frozen=True)
class ScanResult:
    """A complete scan as the budget search reads it: each unit's KL alone, the whole-model KL and the measurement
    passes it took. The scan's JSON record (its cache, sensitivity_report.json) stays as ``scan`` writes it."""

    layers: tuple[UnitKL, ...]
    whole_model_kl: float
    measurement_passes: float | None = None
    cache_hit: bool | None = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> ScanResult:
        """The typed view of a complete scan's record."""
        units = tuple(UnitKL(r["layer"], float(r["kl"]), r.get("pattern", r["layer"])) for r in record["layers"])
        return cls(units, float(record["whole_model_kl"]), record.get("cost", {}).get("measurement_passes"),
                   record.get("cache_hit"))


def scan_result(opts: ScanOptions, progress: Progress = print) -> ScanResult:
    """The complete scan of ``opts`` (cached, or measured now: its session is let go), typed."""
    record, _ = scan(opts, progress)
    return ScanResult.of(record)


def scan(opts: ScanOptions, progress: Progress = print) -> tuple[dict[str, Any], Session | None]:
    """The scan result (cached or measured: per-layer KL plus the whole-model KL) and, when it was
    measured now, the live session (for re-measuring combinations without quantizing again)."""
    from quark_ptq_eval.base.textdata import load_texts
    from quark_ptq_eval.execute.quark_api_parts import calibration_batches

    tokenizer = _tokenizer(opts)
    texts = load_texts(opts.calib_data)
    batches = calibration_batches(tokenizer, texts, opts.seq_len, opts.num_samples, 1, opts.device)
    key = scan_key(model_digest(opts.model_dir), opts.scheme, opts.exclude,
                   tokens_digest([b[0].tolist() for b in batches]), opts.device, opts.layer_config,
                   opts.expert_units)
    cache = ScanCache(key, opts.cache_root)
    if opts.use_cache and (hit := cache.load_final()) is not None:
        progress(f"sensitivity: cache hit ({cache.final}); no model pass needed")
        return {**hit, "cache_hit": True}, None
    done = cache.load_journal() if opts.use_cache else {}
    t0 = time.time()
    session = open_session(opts, batches)
    setup_s = time.time() - t0
    names = list(session.units)
    todo = [n for n in names if n not in done]
    if done:
        progress(f"sensitivity: resuming, {len(done)} of {len(names)} layers already measured")
    rows = dict(done)
    _measure_all(session, todo, rows, cache, progress, opts.estimate_only, len(names))
    if opts.estimate_only and len(rows) < len(names):
        return {"status": "estimated", "key": key, "measured": len(rows), "layers": len(names)}, session
    whole = measure_kl(session, set(session.layers))
    passes = round(sum(r.get("passes", 0.0) for r in rows.values()) + 1, 2)  # + the whole-model pass
    result = {
        "format": 1, "method_version": METHOD_VERSION, "key": key, "status": "complete",
        "model": str(opts.model_dir), "scheme": opts.scheme, "exclude": opts.exclude,
        "calibration": {"source": str(opts.calib_data), "samples": len(batches), "seq_len": int(batches[0].shape[1])},
        "method": "replay from the layer's block on cached inputs" if session.decoder else "full forward passes",
        "cost": {"calibration_passes": 1, "reference_passes": 1, "measurement_passes": passes,
                 "layers": len(names), "setup_s": round(setup_s, 1), "scan_s": round(time.time() - t0, 1)},
        "whole_model_kl": whole, "quantized_share": session.share, "expert_units": opts.expert_units,
        "experts": experts_summary(session),
        "source_bits": _source_bits(session), "scheme_bits": scheme_bits(session),
        "layers": [rows[n] for n in names],
    }
    if opts.use_cache:
        cache.save_final(result)
    return {**result, "cache_hit": False}, session


def _tokenizer(opts: ScanOptions) -> PreTrainedTokenizerBase:
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()  # "sequence longer than max length": we window it

    return AutoTokenizer.from_pretrained(opts.model_dir, trust_remote_code=opts.trust_remote_code)


def _measure_all(session: Session, todo: list[str], rows: dict[str, Any], cache: ScanCache, progress: Progress,
                 estimate_only: bool, total: int) -> None:
    t_start = time.time()
    for i, name in enumerate(todo, 1):
        before = session.passes
        unit = session.units[name]
        kl = measure_kl(session, set(unit.members), pinned=True)
        row = {"layer": name, "kl": kl, "params": sum(_params(session.layers[m]["module"]) for m in unit.members),
               "module_type": module_type(unit), "block": _block(session, unit.members[0]),
               "passes": round(session.passes - before, 4), "kind": unit.kind, "pattern": unit.pattern,
               "members": len(unit.members)}
        rows[name] = row
        cache.append(row)
        if i == min(ESTIMATE_AFTER, len(todo)):
            per = (time.time() - t_start) / i
            left = per * (len(todo) - i)
            progress(f"sensitivity: measured {per:.2f} s per layer on the first {i}; "
                     f"about {left:.0f} s for the other {len(todo) - i} layer(s)")
            if estimate_only:
                return
        elif i % 10 == 0 or i == len(todo):
            progress(f"sensitivity: layer {len(rows)}/{total}")


def _source_bits(session: Session) -> float:
    module = next(iter(session.layers.values()))["module"]
    return float(module.weight.element_size() * 8)


def scheme_bits(session: Session, layer: str | None = None) -> float:
    """Stored bits per weight of ``layer`` (a name or pattern; default: the first) under its scheme: element bits plus the
    group's scale (8-bit power-of-two scales for MX formats, else the scale's float width)."""
    name = next((n for n in session.layers if layer is None or fnmatchcase(n, layer)), next(iter(session.layers)))
    q = session.layers[name]["module"]._weight_quantizer
    q = q[0] if isinstance(q, list) or (hasattr(q, "__getitem__") and not hasattr(q, "dtype")) else q
    dtype = str(getattr(getattr(q, "dtype", None), "value", getattr(q, "dtype", "")))
    digits = re.findall(r"\d+", dtype.replace("e4m3", "").replace("e5m2", "").replace("e2m1", ""))
    bits = float(digits[0]) if digits else 16.0
    group = getattr(q, "group_size", None) or 0
    if group > 0:
        spec = getattr(q, "quant_spec", q)
        scale = f'{getattr(getattr(spec, "scale_type", None), "value", "")} {getattr(spec, "scale_format", "")}'
        bits += (8.0 if any(k in scale for k in ("pof2", "e8m0", "e5m3")) else 32.0 if "float32" in scale else
                 16.0) / group
    return bits


def _block(session: Session, name: str) -> int | None:
    if session.decoder is not None:
        return session.decoder.block_of(name)
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _params(module: torch.nn.Module) -> int:
    weight = getattr(module, "weight", None)
    return int(weight.numel()) if weight is not None else 0


def open_session(opts: ScanOptions, batches: list[Any]) -> Session:
    """Load and prepare as the engine does, record the reference pass (and the MoE routing), quantize
    once with Quark (fake-quant, the engine's template config), switch everything off."""
    import torch
    import transformers

    from quark_ptq_eval.base.quark_import import import_quark_torch
    from quark_ptq_eval.execute.quark_api_parts import (
        loaded_exclusions,
        prepare_for_quantization,
        template_config,
    )
    from quark_ptq_eval.sensitivity.emulation import use_cpu_emulation

    import_quark_torch()  # Quark's scan of transformers answered from our cache (quark_import.py)
    from quark.torch import ModelQuantizer
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        opts.model_dir, dtype="auto", trust_remote_code=opts.trust_remote_code
    ).to(opts.device).eval()  # type: ignore[arg-type]  # transformers' decorated .to() reads as unbound to mypy
    prepare_for_quantization(model)  # the engine's step: per-expert linears, as the export holds them
    routing = Routing()
    decoder, reference = _reference_pass(model, batches, routing, opts.replay)
    config = template_config(model.config.model_type, opts.scheme, layer_config=opts.layer_config,
                             exclude_layers=loaded_exclusions(model, opts.model_dir, opts.exclude))
    with torch.no_grad():
        model = ModelQuantizer(config).quantize_model(model, batches)
    if str(opts.device).startswith("cpu"):
        use_cpu_emulation(model)
    if decoder is not None:  # Quark swaps quantized modules in place: take the head as it is now
        decoder.head = model.get_output_embeddings()
    routing.pin(model)
    layers = _quantized_layers(model)
    session = Session(model, batches, reference, layers, decoder, measurement_units(list(layers), opts.expert_units),
                      routing, quantized_share(model, layers))
    for entry in session.layers.values():
        for q in entry["quantizers"]:
            session.saved[id(q)] = (q.fake_quant_enabled, q.observer_enabled)
    _switch(session, set(session.layers), on=False)
    return session


def _reference_pass(model: PreTrainedModel, batches: list[Any], routing: Routing, use_replay: bool) -> tuple[Decoder | None, list[Any]]:
    """Reference log-probs (nothing quantized), each block's inputs and each MoE layer's routing."""
    decoder = find_decoder(model)
    routing.record(model)
    try:
        reference = capture_inputs(decoder, model, batches) if decoder is not None else _full_pass(model, batches)
    finally:
        routing.stop_recording()
    if decoder is not None and not (use_replay and replay_matches(decoder, reference)):
        decoder = None
    return decoder, reference


def quantized_share(model: torch.nn.Module, layers: dict[str, Any]) -> dict[str, Any]:
    """Weight parameters quantized / all matrix parameters, counted as the validator counts the export's
    headers: every weight of two or more dimensions except embeddings (routers and lm_head included)."""
    from quark_ptq_eval.base.schemes import is_embedding

    total = quantized = 0
    for name, module in model.named_modules():
        weight = getattr(module, "_parameters", {}).get("weight")
        if weight is None or weight.ndim < 2 or is_embedding(name):
            continue
        total += weight.numel()
        if name in layers and getattr(module, "_weight_quantizer", None) is not None:
            quantized += weight.numel()
    return {"quantized_params": quantized, "matrix_params": total,
            "share": round(quantized / total, 4) if total else 0.0}


def experts_summary(session: Session) -> dict[str, Any]:
    """Per MoE layer: the calibration tokens each expert received, and the experts none reached."""
    counts = session.routing.tokens_per_expert()
    unreached = {name: [e for e, n in enumerate(c) if n == 0] for name, c in counts.items()}
    return {"moe_layers": len(counts), "experts": sum(len(c) for c in counts.values()),
            "tokens_per_expert": counts, "unreached": {k: v for k, v in unreached.items() if v},
            "routing": "each unit measured with the routing of the unquantized model's own pass",
            "unreached_treatment": UNREACHED_TREATMENT}


UNREACHED_TREATMENT = ("an expert no calibration token reached is quantized like the others (its weights need no "
                       "calibration) but moves no token of the slice: its KL here is 0, which says nothing about it; "
                       "it is listed here, and the proposal, which ranks by KL, leaves it at the scheme")


def _full_pass(model: torch.nn.Module, batches: list[Any]) -> list[Any]:
    import torch

    from quark_ptq_eval.sensitivity.replay import log_probs

    with torch.no_grad():
        return [log_probs(model(b, use_cache=False).logits) for b in batches]


def _quantized_layers(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every module Quark attached a quantizer to, with its quantizers flattened (lists unrolled)."""
    from quark.torch.quantization.nn.modules.mixin import QuantMixin

    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantMixin):
            continue
        found: list[Any] = []
        for attr in ("_weight_quantizer", "_input_quantizer", "_output_quantizer", "_bias_quantizer"):
            q = getattr(module, attr, None)
            if q is not None:
                found.extend(q if hasattr(q, "__iter__") and not hasattr(q, "fake_quant_enabled") else [q])
        found = [q for q in found if hasattr(q, "fake_quant_enabled")]
        if found:
            layers[name] = {"module": module, "quantizers": found}
    return layers


def _switch(session: Session, names: set[str], on: bool) -> None:
    """On: back to the state Quark left after calibration. Off: no fake-quant, no observer."""
    for name in names:
        for q in session.layers[name]["quantizers"]:
            fake, observe = session.saved[id(q)] if on else (False, False)
            q.fake_quant_enabled, q.observer_enabled = fake, observe


def measure_kl(session: Session, quantized: set[str], pinned: bool = False) -> float:
    """Mean per-token KL(reference || model with exactly ``quantized`` layers quantized); ``pinned``: every
    MoE layer routes as in the reference pass (a unit's own effect), else live (the real model)."""
    import torch

    if not quantized:  # everything kept out: the reference model itself
        return 0.0
    _switch(session, quantized, on=True)
    session.routing.pinned = pinned
    try:
        start = _start_block(session, quantized)
        total, tokens = 0.0, 0
        with torch.no_grad():
            for i, (batch, ref) in enumerate(zip(session.batches, session.reference, strict=True)):
                session.routing.batch = i
                got = replay(session.decoder, start, i) if start is not None and session.decoder is not None else \
                    _full_pass(session.model, [batch])[0]
                total += float((ref.exp() * (ref - got)).sum(-1).double().sum())
                tokens += ref.shape[0] * ref.shape[1]
        n_blocks = len(session.decoder.blocks) if session.decoder else 1
        session.passes += 1.0 if start is None else (n_blocks - min(start, n_blocks) + 0.5) / (n_blocks + 0.5)
    finally:
        session.routing.pinned = False
        _switch(session, quantized, on=False)
    kl = total / max(tokens, 1)
    # float32 rounding makes a harmless layer's KL a tiny negative number: KL is never below 0.
    return max(kl, 0.0) if math.isfinite(kl) else kl


def _start_block(session: Session, names: set[str]) -> int | None:
    if session.decoder is None:
        return None
    blocks = [session.decoder.block_of(n) for n in names]
    return min(len(session.decoder.blocks) if b is None else b for b in blocks)
