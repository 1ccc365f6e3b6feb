"""The budget search's cost model beyond one linear's bytes (knapsack.py ``linear_bytes``): a size budget as the
effective bits it leaves the quantized linears, and the bits of the narrowest mix (a budget below it is refused
before any scan runs). Every byte is read from the safetensors headers (base/safetensors_io.py)."""

from __future__ import annotations

from pathlib import Path

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.safetensors_io import read_header, read_model_headers, weight_files
from quark_ptq_eval.budget.ask import BudgetAsk
from quark_ptq_eval.budget.knapsack import linear_bytes
from quark_ptq_eval.plan.groups import ROUTED

FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
HEADER_ENTRY = 90  # bytes of a safetensors header entry besides its name: dtype, shape, offsets, JSON punctuation


def size_bits(ask: BudgetAsk, model_path: str, shapes: dict[str, tuple[int, int]], float_bytes: int) -> float:
    """The effective bits a size budget leaves the quantized linears. The export's safetensors keep every other
    tensor as the source holds it (embeddings, norms, excluded layers, in the source's width) and carry headers:
    the source's, plus an entry per scale, zero point and input scale of each quantized linear (estimated)."""
    assert ask.size_bytes is not None
    params = sum(r * c for r, c in shapes.values()) or 1
    kept = sum(i.nbytes for i in read_model_headers(model_path).values()) - params * float_bytes
    headers = header_bytes(model_path) + sum(3 * (len(n) + HEADER_ENTRY) for n in shapes)
    bits = 8 * (ask.size_bytes - kept - headers) / params
    if bits <= 0:
        raise UsageError(f"{ask.given} is less than what the export keeps unquantized ({(kept + headers) / 1e9:.3g} GB "
                         "of embeddings, norms, excluded layers and headers).", "Raise --budget-size.")
    return bits


def header_bytes(model_dir: str | Path) -> int:
    """The safetensors headers' bytes, each shard's length field included (where its tensors' data starts)."""
    return sum(read_header(shard).data_start for shard in weight_files(model_dir))


def scale_bytes(model_path: str) -> int:
    """Quark writes a float scale in the source's float width (measured: F32 scales for an F32 model)."""
    dtypes = [i.dtype for n, i in read_model_headers(model_path).items() if n.endswith(".weight")]
    return max((FLOAT_BYTES.get(d, 2) for d in dtypes), default=2)


def check_reachable(budget: float, ask: BudgetAsk, formats: list[str], shapes: dict[str, tuple[int, int]],
                    float_bytes: int, refused: dict[str, str]) -> None:
    """Refuse a budget below every linear in its narrowest format (a lower bound on any mix; routed experts in
    their narrowest the target serves for experts), before measuring."""
    from quark_ptq_eval.base.schemes import load_scheme_table

    table = (load_scheme_table() or {"schemes": {}})["schemes"]
    params = sum(r * c for r, c in shapes.values()) or 1

    def narrowest(name: str, rows: int, cols: int) -> float:
        allowed = [f for f in formats if not (refused and ROUTED.match(name) and f in refused)]
        return min(linear_bytes(table.get(f, {}).get("weight"), rows, cols, float_bytes) for f in allowed)

    lo = 8 * sum(narrowest(n, r, c) for n, (r, c) in shapes.items()) / params
    if budget < lo:
        said = "" if ask.bits is not None else f" ({ask.given})"
        experts = (f"; the routed experts only in {', '.join(f for f in formats if f not in refused)}, as the target "
                   f"serves them ({next(iter(refused.values()))})" if refused else "")
        raise UsageError(f"No mix of {', '.join(formats)} fits {budget:g} effective bits{said}: every quantized "
                         f"linear in its narrowest format takes {lo:.3f} (scales and zero points included{experts}).",
                         f"Raise the budget to at least {lo:.3f} effective bits, or add a narrower format to --formats.")
