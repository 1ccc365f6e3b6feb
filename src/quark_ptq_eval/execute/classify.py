"""Classify an engine failure from its log: cause, evidence lines, the smallest change to try.

Rules are data, checked in order; the first that matches an evidence line wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


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
       r"requires a CUDA device|"
       r"Found no NVIDIA driver|CUDA driver version|libamdhip|torchvision",
       "Install a torch/torchvision pair that matches each other and the accelerator, then re-run `quark-ptq-eval preflight`."),
    _r("load", r"size mismatch|Error\(s\) in loading|Can't load|Unable to load|OSError: .*(config|model|safetensors)|offloaded|meta tensor|"
       r"LocalEntryNotFoundError|couldn't connect to 'https://huggingface.co'|Couldn't reach",
       "Check the model directory loads with transformers on this device; offline, pass --calib-data and a local model."),
    _r("compatibility", r"not supported|Unsupported|KeyError: '.*model_type|does not recognize this architecture|"
       r"no template", "Pick a scheme/model type the installed Quark supports (see `quark-ptq-eval plan --help`)."),
    _r("dtype", r"expected m1 and m2 to have the same dtype|must have the same dtype|expected scalar type \w+ but found|"
       r"Input type \(\w+\) and (weight|bias) type",
       "A layer got inputs in another dtype than its weights (the model's code mixes float32 and BF16 tensors): "
       "it is the modelling code, not a quantization choice, so {instead} will not change it; report the log "
       "with the model type."),
    _r("configuration", r"error: (argument|unrecognized)|invalid choice|Invalid --|ValueError: .*(scheme|layer|exclude)",
       "Fix the plan value named in the evidence and re-approve the plan."),
    _r("export", r"export|safetensors_rust|No space left|Disk quota|File too large|Errno 28|Errno 27",
       "Free disk space at the output location (or choose another -o) and re-run."),
    _r("quantization", r"quantiz|calibrat|observer|\bnan\b|\binf\b|^\w*(Error|Exception)\b",
       "{Instead}, with more calibration samples, or exclude the failing layer."),
)


FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
# Where the failing frame's file lives -> (cause, package), checked in order.
FRAME_OWNERS = (("/transformers/", "load", "transformers"), ("/accelerate/", "load", "accelerate"),
                ("/quark/", "quark", "amd-quark"))


def _package_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(version unknown)"


def classify_by_frame(log_lines: list[str], returncode: int) -> dict[str, Any] | None:
    """The traceback's failing frame (its last ``File ...`` line) names where it failed: loading code
    in transformers/accelerate means load, Quark's own code means Quark, whatever the message says."""
    frames = [(i, m) for i, ln in enumerate(log_lines) if (m := FRAME.match(ln))]
    if not frames:
        return None
    i, frame = frames[-1]
    owner = next(((cause, pkg) for part, cause, pkg in FRAME_OWNERS if part in frame["path"]), None)
    if owner is None:
        return None
    cause, package = owner
    error = next((ln.strip() for ln in log_lines[i + 1:] if re.match(r"^\w[\w.]*(Error|Exception)\b", ln)), "")
    where = f"{package} {_package_version(package)}, {frame['path'].rpartition('/site-packages/')[2]}:" \
            f"{frame['line']} in {frame['func']}"
    if cause == "load":
        proposal = (f"It failed inside {where} while loading the model, not in quantization: check that this "
                    f"{package} loads the model on this device (an FP8 release needs the plan's BF16 staging copy), "
                    f"or install a {package} version that does.")
    else:
        proposal = (f"It failed inside Quark's own code ({where}): try another scheme or algorithm, and report "
                    "the log to Quark if it persists.")
    return {"cause": cause, "evidence": [f"failing frame: {where}", *([error] if error else [])],
            "proposal": proposal, "returncode": returncode, "package": package}


def asked_of(argv: list[str]) -> dict[str, str | None]:
    """The scheme and algorithm an engine command asks for (quark-cli's flags, which every engine takes)."""
    def flag(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv[:-1] else None

    return {"scheme": flag("--quant_scheme"), "algorithm": flag("--quant_algo")}


def _instead(asked: dict[str, str | None] | None) -> str:
    """The retry a proposal names: without the algorithm that was asked, else with another scheme."""
    asked = asked or {}
    if asked.get("algorithm"):
        return f"retry without the algorithm {asked['algorithm']}"
    return f"retry with another scheme than {asked['scheme']}" if asked.get("scheme") else "retry with another scheme"


def _proposal(rule: Rule, asked: dict[str, str | None] | None) -> str:
    instead = _instead(asked)
    return rule.proposal.format(instead=instead, Instead=instead[:1].upper() + instead[1:])


def classify_failure(log_lines: list[str], returncode: int,
                     asked: dict[str, str | None] | None = None) -> dict[str, Any]:
    """``asked``: the scheme and algorithm of the command (``asked_of``), which the proposal names."""
    # The traceback header says nothing; the exception lines and messages are the evidence.
    evidence_pool = [ln for ln in log_lines if ln.strip() and not ln.startswith("Traceback (most recent")]
    if returncode in (-9, 137):
        # SIGKILL: the log only shows how far the engine got (often "quantizing"), not why it died;
        # matching the log would blame that step. The usual sender is the out-of-memory killer.
        return {"cause": "memory", "evidence": [f"the engine was killed by SIGKILL (exit {returncode}), usually the "
                                                "kernel's out-of-memory killer (see `dmesg`)", *evidence_pool[-1:]],
                "proposal": RULES[0].proposal, "returncode": returncode}
    by_frame = classify_by_frame(log_lines, returncode)
    if by_frame and not RULES[0].pattern.search(" ".join(by_frame["evidence"])):  # an OOM stays memory
        return by_frame
    for rule in RULES:
        hits = [ln.strip() for ln in evidence_pool if rule.pattern.search(ln)]
        if hits:
            return {"cause": rule.cause, "evidence": hits[-5:], "proposal": _proposal(rule, asked),
                    "returncode": returncode}
    return {"cause": "unknown", "evidence": evidence_pool[-5:], "returncode": returncode,
            "proposal": "Read the full log; re-run after fixing the first error it shows."}
