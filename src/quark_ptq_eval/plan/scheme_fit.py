"""Does the scheme fit the model? Group and block sizes against every linear the plan quantizes.

A per-group (or MX block) spec splits each row of a weight, and each input activation row, into
groups along the input dimension: Quark 0.13 needs every group whole (its observer reshapes the
row into ``[-1, group_size]`` and fails otherwise, after the engine has started). A sub-byte
integer per-group weight also packs its zero points along the output dimension,
``qparams_per_item`` to an int32 (``quark/torch/utils/pack.py``: ``out // 8`` for int4), which its
importer infers by floor division. Both are read here from the safetensors headers, per linear,
every MoE expert of a fused 3-D tensor (either orientation) or of 4-D MXFP4 blocks included, so the
plan knows before anything runs.

A scheme the planner chose (from the target, the priority or a format word in the goal) that does
not fit is replaced by the nearest one that does (same spec, a smaller group: ``int4_wo_128`` ->
``int4_wo_64`` -> ``int4_wo_32``), with the reason; a scheme the user named is refused at the
plan step with that alternative.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.safetensors_io import read_model_headers, weight_files
from quark_ptq_eval.base.schemes import as_spec_list, dtype_bits, is_embedding, is_integer, meaning
from quark_ptq_eval.intake.formats import is_scale

ROLES = ("weight", "input_tensors")  # the specs that split the input dimension
NON_LINEAR = ("norm", "rotary")  # as intake counts linears; embeddings by name (is_embedding)
SCALES = ("_scale", "_scale_inv")  # fused experts' scales (``gate_up_proj_scale_inv``), besides intake's


@dataclass(frozen=True)
class Misfit:
    module: str
    dim: int  # the dimension that does not divide
    need: int  # what it must be a multiple of
    what: str  # "input dimension" / "output dimension"


def linear_shapes(model_path: str, excludes: list[str]) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear the plan quantizes, from the headers; fused experts one per expert."""
    if not weight_files(model_path):
        return {}
    tensors = read_model_headers(model_path)
    shapes: dict[str, tuple[int, int]] = {}
    for name, info in tensors.items():
        module, _, leaf = name.rpartition(".")
        if any(h in name for h in NON_LINEAR) or is_embedding(module) or is_scale(name) or leaf.endswith(SCALES):
            continue  # a scale's dims are not its weight's (MXFP4 *_scales [E, out, in/32])
        if leaf == "weight" and len(info.shape) == 2:
            shapes[module] = (info.shape[0], info.shape[1])
        elif ".experts" in name and (matrix := _expert_matrix(name, info.shape, tensors)):
            leaf, rows, cols = matrix[0].rpartition(".")[2], *matrix[1:]
            projs = ("gate_proj", "up_proj") if "gate_up" in leaf else (leaf.removesuffix("_weight"),)
            for e in range(info.shape[0]):  # named as Quark's preprocessing splits them
                shapes.update({f"{module}.{e}.{p}": (rows // len(projs), cols) for p in projs})
    return {m: s for m, s in shapes.items() if not any(fnmatchcase(m, p) for p in excludes)}


def _expert_matrix(name: str, shape: tuple[int, ...], tensors: dict[str, Any]) -> tuple[str, int, int] | None:
    """(tensor name, out, in) of each expert's matrix in a fused expert tensor: transformers 5's [E, out, in];
    [E, in, out] where the family stores it transposed (gpt-oss: its ``<name>_bias`` [E, out] says so);
    gpt-oss MXFP4 ``<name>_blocks`` [E, out, in/32, 16] (two E2M1 codes a byte)."""
    if len(shape) == 4 and name.endswith("_blocks"):
        return name.removesuffix("_blocks"), shape[1], shape[2] * shape[3] * 2
    if len(shape) != 3 or name.endswith("_bias"):
        return None
    bias = tensors.get(name + "_bias")
    transposed = bias is not None and bias.shape[-1] == shape[2] != shape[1]
    return (name, shape[2], shape[1]) if transposed else (name, shape[1], shape[2])


def misfits(layer_spec: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> list[Misfit]:
    """Each linear whose input (group size) or output (packed zero points) the spec cannot split."""
    out: list[Misfit] = []
    for module, (rows, cols) in shapes.items():
        for role in ROLES:
            for spec in as_spec_list(layer_spec.get(role)):
                group = spec.get("group_size")
                if isinstance(group, int) and group > 1 and cols % group:
                    out.append(Misfit(module, cols, group, "input dimension"))
                pack = _zero_point_pack(spec) if role == "weight" else 0
                if pack and rows % pack:
                    out.append(Misfit(module, rows, pack, "output dimension"))
    return out


def _zero_point_pack(spec: dict[str, Any]) -> int:
    """Values per int32 of a sub-byte integer per-group weight's zero points (0: no constraint)."""
    bits = dtype_bits(spec.get("dtype"))
    if spec.get("qscheme") == "per_group" and is_integer(spec.get("dtype")) and bits and bits < 8:
        return 32 // bits
    return 0


def _variants(scheme: str, schemes: dict[str, Any], known: list[str]) -> list[str]:
    """Schemes Quark builds exactly as ``scheme`` but for the group size, largest group first."""
    def shape_of(name: str) -> list[Any]:
        return [[{k: v for k, v in (m or {}).items() if k != "group_size"} for m in meaning(schemes[name].get(r)) or []]
                for r in ROLES]

    def group(name: str) -> int:
        return max((s.get("group_size") or 0 for r in ROLES for s in as_spec_list(schemes[name].get(r))), default=0)

    same = [n for n in known if n in schemes and n != scheme and shape_of(n) == shape_of(scheme)]
    return sorted((n for n in same if group(n) < group(scheme)), key=group, reverse=True)


def _text(bad: list[Misfit]) -> str:
    first, others = bad[0], len({b.module for b in bad}) - 1
    more = f" (and {others} more linear(s))" if others else ""
    return f"{first.module}'s {first.what} {first.dim} is no multiple of {first.need}{more}"


def fit_scheme(scheme: str, why: str, user_named: bool, shapes: dict[str, tuple[int, int]],
               table: dict[str, Any] | None, known: list[str], fallbacks: tuple[str, ...] = ()) -> tuple[str, str]:
    """(scheme, reason): ``scheme`` when it fits; else the nearest that does (the same format with smaller
    groups, then ``fallbacks``: the target's other formats), or a refusal for a scheme the user named."""
    schemes = (table or {}).get("schemes") or {}
    if scheme not in schemes or not shapes:
        return scheme, why
    bad = misfits(schemes[scheme], shapes)
    if not bad:
        return scheme, why
    nearest = [*_variants(scheme, schemes, known), *(f for f in fallbacks if f in schemes and f in known)]
    fitting = next((v for v in nearest if v != scheme and not misfits(schemes[v], shapes)), None)
    problem = f"{scheme} cannot quantize this model: {_text(bad)}"
    if user_named or fitting is None:
        hint = (f"Use --scheme {fitting}, the same format with groups that divide every quantized linear."
                if fitting else "Use a per-channel or per-tensor scheme (fp8, int8, ptpc_fp8, int4_wo_per_channel), "
                                "or exclude the layers that do not divide (--exclude).")
        raise UsageError(f"{problem}; Quark would fail in its observer after the engine started.", hint)
    return fitting, f"{why}; {fitting} instead of {scheme}: {_text(bad)}, and {fitting} fits every quantized linear"


def check_overrides(overrides: dict[str, str], shapes: dict[str, tuple[int, int]], table: dict[str, Any] | None,
                    known: list[str]) -> None:
    """A per-pattern override the user named must fit the linears its pattern matches."""
    for pattern, scheme in overrides.items():
        matched = {m: s for m, s in shapes.items() if fnmatchcase(m, pattern)}
        fit_scheme(scheme, "asked for explicitly", True, matched, table, known)


@dataclass(frozen=True)
class SchemeChoice:
    """The scheme chosen, why, whether the user named it (a named one is refused, never replaced) and
    the schemes a planner's choice may fall back to, nearest first."""

    scheme: str
    why: str = ""
    user_named: bool = True
    fallbacks: tuple[str, ...] = ()


def fit_to_model(model_path: str, choice: SchemeChoice, overrides: dict[str, str], excludes: list[str],
                 known: list[str]) -> tuple[str, str]:
    """The plan step's check: overrides against the linears they match, the global scheme against the rest."""
    from quark_ptq_eval.base.schemes import load_scheme_table

    shapes = linear_shapes(model_path, excludes)
    if not shapes:
        return choice.scheme, choice.why  # no local headers: nothing to hold the groups against
    table = load_scheme_table()
    check_overrides(overrides, shapes, table, known)
    rest = {m: s for m, s in shapes.items() if not any(fnmatchcase(m, p) for p in overrides)}
    return fit_scheme(choice.scheme, choice.why, choice.user_named, rest, table, known, choice.fallbacks)
