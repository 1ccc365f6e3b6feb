#!/bin/bash
# The suite's thread setting, A/B: the same test subset on two workers with torch's default threads (A) and
# with one OpenMP thread per worker (B, what tests/conftest.py sets under xdist), interleaved A B A B.
# Prints the load beside each wall time. Run from the repository root: bash bench/suite/suite_threads.sh
SUB="tests/validate tests/sensitivity tests/evaluate/ppl/test_eval_ppl.py tests/plan tests/intake"
for cfg in A B A B; do
  load=$(cut -d' ' -f1 /proc/loadavg)
  start=$(date +%s)
  if [ "$cfg" = B ]; then threads=1; else threads=""; fi
  # conftest only sets OMP_NUM_THREADS when it is unset: A passes the host's core count explicitly
  OMP_NUM_THREADS=${threads:-$(nproc)} .venv/bin/python -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider \
    $SUB > /tmp/suite_threads_$cfg.log 2>&1
  echo "$cfg threads=${threads:-default} wall $(( $(date +%s) - start )) s, load at start $load: $(tail -1 /tmp/suite_threads_$cfg.log)"
done
