"""The crash campaign's slice in the suite (bench/crash_campaign.py runs the figure): one clean demo
run shared by the module, then the same recipe from scratch SIGKILLed (its whole process tree) at
seeded instants over that run's span, resumed (a resume killed once more in the first trial) until
it finishes; `status` right at every stop, the export byte-identical to the clean run's, the reports
complete and schema-valid, nothing left behind.

Slow: each trial is a full demo run (the engine, validation with the load check, Tier 1 with the
baseline).
"""

from __future__ import annotations

import random

import pytest

from bench import crash_campaign
from tests.reliability.test_reliability_guard import source_guard  # noqa: F401 - arms the session guard early

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("source_guard")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_llama, corpus):
    return crash_campaign.take_reference(tiny_llama, corpus, tmp_path_factory.mktemp("crash") / "reference")


@pytest.mark.parametrize("seed, rekill", [(3, 1.0), (11, 0.0)], ids=["killed-twice", "killed-once"])
def test_a_run_killed_at_a_seeded_instant_resumes_to_the_clean_end_state(reference, tiny_llama, corpus, tmp_path,
                                                                         seed, rekill):
    assert reference.validation == "success" and reference.verdict
    rng = random.Random(seed)
    trial = crash_campaign.run_trial(seed, reference, tiny_llama, corpus, tmp_path / "trial", rng, rekill,
                                     max_kills=2)
    assert trial.kills, f"the run ended before the instant {trial.instant} s drawn over {reference.seconds:.0f} s"
    assert trial.mismatches == [], trial
    assert trial.resumes >= len(trial.kills)
