"""Tier 1 through vLLM: perplexity from a vLLM server's prompt log-probabilities on the same token
windows HF Tier 1 scores, so a user sees whether the two backends agree on the same checkpoint.

Each window goes to ``/v1/completions`` as its token ids with ``echo`` and ``logprobs=0``: the
response carries the log-probability of every prompt token given the ones before it (the first has
none), exactly the ``n - 1`` predictions HF Tier 1 averages per window (ppl.tier.score_batch).
"""

from __future__ import annotations

import math
import shlex
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import QpeError

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.evaluate.context import TierInputs

# Relative perplexity difference above which the two backends are said to disagree. vLLM runs its
# own kernels on the same weights; on the demo model's int8 export the two differ by +0.04 % over 32
# windows of 512 tokens (bench/README.md, "HF vs vLLM Tier 1"): the tolerance is about ten times that.
AGREEMENT_TOLERANCE_PCT = 0.5
CONCURRENT_REQUESTS = 8


@dataclass
class BackendComparison:
    hf_perplexity: float
    vllm_perplexity: float
    difference_pct: float  # (vLLM - HF) / HF, percent
    tolerance_pct: float
    agree: bool
    windows: int
    hf_seconds: float | None = None
    vllm_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sentence(self) -> str:
        verdict = "agree" if self.agree else "DISAGREE"
        return (f"HF and vLLM {verdict} on perplexity over the same {self.windows} windows: HF {self.hf_perplexity:.4f}, "
                f"vLLM {self.vllm_perplexity:.4f} ({self.difference_pct:+.2f} %, tolerance ±{self.tolerance_pct:g} %).")


def window_nll(base_url: str, model: str, window: list[int], timeout_s: float = 600) -> float:
    """Mean negative log-likelihood of ``window[1:]`` given what precedes each token, from vLLM."""
    # echo: the prompt's log-probabilities come back before the one generated token (discarded)
    from quark_ptq_eval.runtime.vllm_host import CompletionRequest, post_completion

    body: CompletionRequest = {"model": model, "prompt": window, "max_tokens": 1, "echo": True, "logprobs": 0,
                               "temperature": 0}
    try:
        choice = post_completion(base_url, body, timeout_s)["choices"][0]
    except urllib.error.HTTPError as exc:  # vLLM says why in the body
        said = exc.read().decode(errors="replace")[:300]
        raise QpeError(f"The vLLM server at {base_url} refused the window ({exc.code}: {said}).") from None
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise QpeError(f"The vLLM server at {base_url} gave no prompt log-probabilities ({exc}).") from None
    logprobs = choice["logprobs"]["token_logprobs"][1 : len(window)]  # first: no context; last+1: generated
    if len(logprobs) != len(window) - 1 or any(v is None for v in logprobs):
        raise QpeError(f"The vLLM server at {base_url} returned {len(logprobs)} prompt log-probabilities for a "
                       f"{len(window)}-token window; it must echo one per prompt token.")
    nll: float = -sum(logprobs) / len(logprobs)
    return nll


def vllm_window_nlls(base_url: str, model: str, windows: torch.Tensor) -> tuple[list[float], float]:
    """Per-window mean NLL from vLLM, in window order, and the seconds it took."""
    rows = [list(map(int, w)) for w in windows.tolist()]
    started = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:  # the server batches concurrent requests
        nlls = list(pool.map(lambda w: window_nll(base_url, model, w), rows))
    return nlls, time.perf_counter() - started


def compare(hf_nll: list[float], vllm_nll: list[float], tolerance_pct: float = AGREEMENT_TOLERANCE_PCT,
            **seconds: float | None) -> BackendComparison:
    """Both perplexities over the same windows (exp of the mean per-window NLL, as Tier 1) and whether
    they agree within ``tolerance_pct``."""
    if len(hf_nll) != len(vllm_nll) or not hf_nll:
        raise QpeError(f"HF scored {len(hf_nll)} windows and vLLM {len(vllm_nll)}: they must score the same ones.")
    hf = math.exp(sum(hf_nll) / len(hf_nll))
    vl = math.exp(sum(vllm_nll) / len(vllm_nll))
    diff = 100.0 * (vl - hf) / hf
    return BackendComparison(hf, vl, diff, tolerance_pct, abs(diff) <= tolerance_pct, len(hf_nll),
                             seconds.get("hf_seconds"), seconds.get("vllm_seconds"))


def cross_check(ctx: TierInputs, windows: torch.Tensor, hf_nll: list[float],
                hf_seconds: float | None = None) -> BackendComparison | None:
    """Tier 1 with --vllm-python: the quantized model's windows scored again by that vLLM, compared with
    HF's. None without an explicit --vllm-python (an environment variable alone never starts a server
    here). A server that does not become healthy is a QpeError in one sentence, as in Tier 3."""
    from quark_ptq_eval.runtime.vllm_host import find_host_vllm, free_port, host_server_argv
    from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy, vllm_server
    from quark_ptq_eval.runtime.vllm_sizing import sized_for

    if ctx.options.vllm_python is None:
        return None
    host = find_host_vllm(ctx.options.vllm_python)
    assert host is not None  # named: found, or UsageError
    port = free_port()
    # the window and the one token generated after it (a window as long as the model's context is refused)
    sizing = sized_for(ctx.model_dir, host.cpu, ctx.options.vllm_args, sequences=CONCURRENT_REQUESTS,
                       context=windows.shape[1] + 1, context_origin="check",
                       context_reason="Tier 1's window and the one token generated after it")
    argv = host_server_argv(host, ctx.model_dir, port, "tier1", sizing)
    log = ctx.workdir / "logs" / "vllm_tier1.log"
    ctx.log(f"HF vs vLLM: scoring the same {windows.shape[0]} windows with {shlex.join(argv)}")
    timeout_s = ctx.options.vllm_health_timeout_s
    try:
        with vllm_server(argv, port, log, timeout_s, what="the HF vs vLLM check"):
            nlls, seconds = vllm_window_nlls(f"http://127.0.0.1:{port}", "tier1", windows)
    except ServerNotHealthy as exc:
        reason = exc.reason or f"not healthy after {timeout_s:g} s"
        raise QpeError(f"The vLLM server for the HF vs vLLM check did not serve the model: "
                       f"{reason.rstrip('.')}; its log is {log}.") from None
    return compare(hf_nll, nlls, hf_seconds=hf_seconds, vllm_seconds=seconds)

