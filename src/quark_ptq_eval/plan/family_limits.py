"""Known family x scheme limits of the installed Quark and transformers, refused before anything runs.

A data table, kept current by the family matrix (``make matrix``, docs/families.md): each entry
names the model type, the schemes it covers ("*" for all), whose limit it is, why, and what to
do instead. The plan step refuses a listed combination up front, so a user never waits for an
engine run that is known to fail.
"""

from __future__ import annotations

from dataclasses import dataclass

from quark_ptq_eval.base.errors import UsageError

ALL = "*"


@dataclass(frozen=True)
class FamilyLimit:
    model_type: str
    schemes: tuple[str, ...]  # ("*",) for every scheme; "scheme+algo" entries name an algorithm too
    owner: str  # "transformers" | "quark" | "recipe" (a scope limit of this tool)
    reason: str
    alternative: str

    def covers(self, scheme: str, algorithm: str | None) -> bool:
        keys = {scheme, ALL, *(f"{scheme}+{a}" for a in (algorithm or "").split(",") if a),
                *(f"{ALL}+{a}" for a in (algorithm or "").split(",") if a)}
        return bool(keys & set(self.schemes))


_IMAGE_TEXT = ("transformers maps this image-text config to no AutoModelForCausalLM class, and the recipe "
               "loads causal language models")
_IMAGE_TEXT_ALT = "run quark-cli torch-llm-ptq on it directly (it loads image-text models), or quantize the text-only variant"

LIMITS: tuple[FamilyLimit, ...] = (
    *(FamilyLimit(t, (ALL,), "recipe", _IMAGE_TEXT, _IMAGE_TEXT_ALT)
      for t in ("glm5_next", "kimi_k25", "minimax_m3_vl", "mllama", "muse_glimmer", "qwen3_vl_moe")),
    FamilyLimit("llama4", (ALL,), "recipe",
                "AutoModelForCausalLM builds Llama 4's text-only Llama4ForCausalLM (model_type llama4_text), "
                "for which Quark 0.13 has no template",
                "run quark-cli torch-llm-ptq on the full Llama 4 checkpoint (it loads the image-text model)"),
    *(FamilyLimit(t, (ALL,), "recipe",
                  f"AutoModelForCausalLM builds the text-only model (model_type {t}_text), for which Quark 0.13 "
                  "has no template",
                  "run quark-cli torch-llm-ptq on the full checkpoint (it loads the image-text model)")
      for t in ("qwen3_5", "qwen3_5_moe")),
)


def limit_for(model_type: str, scheme: str, algorithm: str | None) -> FamilyLimit | None:
    return next((lim for lim in LIMITS if lim.model_type == model_type and lim.covers(scheme, algorithm)), None)


def check_family_limits(model_type: str, scheme: str, algorithm: str | None) -> None:
    """Refuse a model type x scheme (x algorithm) the table knows cannot work, with the way out."""
    lim = limit_for(model_type, scheme, algorithm)
    if lim is None:
        return
    what = f"{scheme}{' with ' + algorithm if algorithm else ''}"
    raise UsageError(f"{model_type} with {what} is a known {lim.owner} limit: {lim.reason}.",
                     f"Instead: {lim.alternative}.")
