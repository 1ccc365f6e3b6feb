"""The crash campaign's slice in the suite (bench/benchmarks/crash_campaign.py runs the figure): one clean demo
run shared by the module, then the same recipe from scratch SIGKILLed (its whole process tree) at
seeded instants over that run's span, resumed (its first resume killed once more) until
it finishes; `status` right at every stop, the export byte-identical to the clean run's, the reports
complete and schema-valid, nothing left behind.

Slow: the reference and the trial are each a full demo run (the engine, validation with the load check, Tier 1 with the
baseline).
"""

from __future__ import annotations

import random

import pytest

from bench.benchmarks import crash_campaign
from tests.reliability.test_reliability_guard import source_guard  # noqa: F401 - arms the session guard early

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("source_guard")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_llama, corpus):
    return crash_campaign.take_reference(tiny_llama, corpus, tmp_path_factory.mktemp("crash") / "reference")


# One trial: the `run` killed at 24 % of the reference's span, its first `resume` (if still running then) at
# 37 % of it; the next `resume` finishes. A trial killed once (a killed `run`, one `resume` to the end) checked nothing
# this one does not: the same status checks at a stop, the same end state after a resume; the instants over
# the whole span (every phase) are the campaign's to cover (bench/benchmarks/crash_campaign.py, 60 trials).
SEED, REKILL, MAX_KILLS = 3, 1.0, 2


def test_a_run_killed_at_a_seeded_instant_and_killed_again_in_its_resume_resumes_to_the_clean_end_state(
        reference, tiny_llama, corpus, tmp_path):
    assert reference.validation == "success" and reference.verdict
    rng = random.Random(SEED)
    trial = crash_campaign.run_trial(SEED, reference, tiny_llama, corpus, tmp_path / "trial", rng, REKILL,
                                     max_kills=MAX_KILLS)
    assert trial.kills, f"the run ended before the instant {trial.instant} s drawn over {reference.seconds:.0f} s"
    assert trial.mismatches == [], trial
    assert trial.resumes >= len(trial.kills)
