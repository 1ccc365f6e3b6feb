"""Classify an engine failure from its log: cause, evidence lines, the smallest change to try.

Rules are data, checked in order; the first that matches an evidence line wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    cause: str
    pattern: re.Pattern[str]
    proposal: str


def _r(cause: str, pattern: str, proposal: str) -> Rule:
    return Rule(cause, re.compile(pattern, re.IGNORECASE), proposal)


RULES: tuple[Rule, ...] = (
    _r("memory", r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory|\bKilled\b|HIP error: out of",
       "Use --multi-device, fewer calibration samples (--num-calib-samples) or a shorter --calib-seq-len."),
    _r("environment", r"ModuleNotFoundError|ImportError|undefined symbol|operator .* does not exist|No CUDA GPUs|"
       r"Found no NVIDIA driver|CUDA driver version|libamdhip|torchvision",
       "Install a torch/torchvision pair that matches each other and the accelerator, then re-run `quark-ptq-eval preflight`."),
    _r("load", r"size mismatch|Error\(s\) in loading|Can't load|Unable to load|OSError: .*(config|model|safetensors)|offloaded|meta tensor|"
       r"LocalEntryNotFoundError|couldn't connect to 'https://huggingface.co'|Couldn't reach",
       "Check the model directory loads with transformers on this device; offline, pass --calib-data and a local model."),
    _r("compatibility", r"not supported|Unsupported|KeyError: '.*model_type|does not recognize this architecture|"
       r"no template", "Pick a scheme/model type the installed Quark supports (see `quark-ptq-eval plan --help`)."),
    _r("configuration", r"error: (argument|unrecognized)|invalid choice|Invalid --|ValueError: .*(scheme|layer|exclude)",
       "Fix the plan value named in the evidence and re-approve the plan."),
    _r("export", r"export|safetensors_rust|No space left|Disk quota|File too large|Errno 28|Errno 27",
       "Free disk space at the output location (or choose another -o) and re-run."),
    _r("quantization", r"quantiz|calibrat|observer|\bnan\b|\binf\b|^\w*(Error|Exception)\b",
       "Retry without the algorithm, with more calibration samples, or exclude the failing layer."),
)


def classify_failure(log_lines: list[str], returncode: int) -> dict:
    # The traceback header says nothing; the exception lines and messages are the evidence.
    evidence_pool = [ln for ln in log_lines if ln.strip() and not ln.startswith("Traceback (most recent")]
    if returncode in (-9, 137):
        # SIGKILL: the log only shows how far the engine got (often "quantizing"), not why it died;
        # matching the log would blame that step. The usual sender is the out-of-memory killer.
        return {"cause": "memory", "evidence": [f"the engine was killed by SIGKILL (exit {returncode}), usually the "
                                                "kernel's out-of-memory killer (see `dmesg`)", *evidence_pool[-1:]],
                "proposal": RULES[0].proposal, "returncode": returncode}
    for rule in RULES:
        hits = [ln.strip() for ln in evidence_pool if rule.pattern.search(ln)]
        if hits:
            return {"cause": rule.cause, "evidence": hits[-5:], "proposal": rule.proposal, "returncode": returncode}
    return {"cause": "unknown", "evidence": evidence_pool[-5:], "returncode": returncode,
            "proposal": "Read the full log; re-run after fixing the first error it shows."}
