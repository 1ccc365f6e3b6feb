"""The family x scheme matrix's columns, read by the runner (bench/docgen/matrix.py) and by the page it writes
(bench/docgen/families_doc.py): one module both import, so neither imports the other for them."""

from __future__ import annotations

# column -> (scheme, algorithm), in the page's order
COLUMNS: dict[str, tuple[str, str | None]] = {
    "fp8": ("fp8", None), "int8": ("int8", None), "int4_wo_32": ("int4_wo_32", None),
    "mxfp4": ("mxfp4", None), "awq": ("int4_wo_32", "awq"), "fp8_release": ("mxfp4", None),
}
# columns whose source is the family's instance as an FP8 block release (DeepSeek's format,
# tests/fixtures/fp8_release.py): the recipe's plan reads it through a dequantized BF16 staging copy
FP8_RELEASE_COLUMNS = ("fp8_release",)
