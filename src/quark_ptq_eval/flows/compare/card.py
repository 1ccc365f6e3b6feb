"""The comparison's hand-off: the model card of the scheme it recommends (only that one: the
schemes' own recipes run with ``--card none``), with why it was chosen, and its upload line."""

from __future__ import annotations

from typing import Any


def card_for_chosen(comparison: Any, doc: dict[str, Any], base_model: str | None = None) -> None:
    """Write the recommended scheme's card (naming ``base_model``, the base's Hub id, when given); ``doc``
    (comparison.json's content) gets its path and upload line."""
    from quark_ptq_eval.publish import ComparisonChoice, upload_command, write_card

    rec = doc.get("recommendation") or {}
    scheme = rec.get("scheme")
    if scheme is None:
        comparison.ui.info("No model card: no scheme is recommended.")
        return
    chosen = ComparisonChoice(rec["reason"], tuple(f"{r['scheme']} ({r.get('status')})" for r in doc.get("schemes") or []),
                              (doc.get("artifacts") or {}).get("report"))
    out = comparison.output_dir(scheme)
    doc["model_card"] = str(write_card(comparison.workdir(scheme), out, base_model=base_model, comparison=chosen))
    doc["upload"] = upload_command(out)
    comparison.ui.info(f"Model card of {scheme}: {doc['model_card']}\n"
                       f"To publish it on the Hugging Face Hub (not run): {doc['upload']}")
