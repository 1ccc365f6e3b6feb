"""What the engines the plan picks by the host's memory (file2file, sequential) share: never the automatic choice
for an accelerator, and a refusal that says why for a plan they cannot serve."""

from __future__ import annotations

from collections.abc import Callable

from quark_ptq_eval.base.catalog import SchemeInfo
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.plan_records import DeviceStrategy, PlannedCalibration

Unsupported = Callable[[SchemeInfo, "str | None", "str | None"], "str | None"]


class MemoryFallback:
    """Chosen by plan/host_fit.py when the whole-model engine does not fit the host, never by the accelerator."""

    def __init__(self, unsupported: Unsupported, refusal: Callable[[str], UsageError]):
        self._unsupported, self._refusal = unsupported, refusal

    def auto_reason(self, accelerator: str, calibration: PlannedCalibration, device_is_cpu: bool) -> str | None:
        return None

    def unsupported_reason(self, scheme_info: SchemeInfo, algorithm: str | None, kv_cache_scheme: str | None) -> str | None:
        return self._unsupported(scheme_info, algorithm, kv_cache_scheme)

    def refusal(self, why: str) -> UsageError:
        return self._refusal(why)

    def check_constraints(self, scheme_info: SchemeInfo, algorithm: str | None, device: DeviceStrategy) -> None:
        why = self._unsupported(scheme_info, algorithm, None)
        if why:
            raise self._refusal(why)
