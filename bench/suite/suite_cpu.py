"""Where a command's CPU goes, by kind of process: ``python -m bench.suite.suite_cpu [--every S] -- make test``.

It runs the command and, every S seconds (3 by default), reads each process's CPU time from /proc; at the end it
sums the processes started during the command by kind (a Quark engine child, a vLLM server, our CLI, a pytest
worker, Ray...), with the wall time, the CPU the host had, the load, and the kernel's DAMON thread beside them.
A process that lives less than S seconds may be missed, and the last S seconds of one that ends are: the figures
are a floor. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
KINDS = (  # (kind, a string its command line holds): the first match names it
    ("Quark engine child", "quark_api_engine"), ("Quark engine child", "engines.file2file"),
    ("quark-cli", "quark-cli"), ("vLLM server", "vllm.entrypoints"), ("vLLM server", "VLLM::"),
    ("vLLM benchmark driver", "speed/driver.py"), ("vLLM child", ".venv-vllm/bin/python"),
    ("lm-eval child", "-m lm_eval"), ("Ray", "ray::"), ("Ray", "raylet"), ("Ray", "gcs_server"), ("Ray", "/ray/"),
    ("our CLI", "-m quark_ptq_eval "), ("our CLI", "bin/quark-ptq-eval"), ("our cache builders", "quark_ptq_eval.base."),
    ("pytest worker", "import sys;exec(eval(sys.stdin.readline()))"), ("mypy", "mypy"), ("pip", "pip install"),
    ("compiler", "g++"), ("compiler", "ninja"), ("pytest", "pytest"),
)


def _snapshot() -> dict[str, tuple[int, str]]:
    """{pid:start ticks: (CPU ticks, command line)} of every process now."""
    seen = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        seen[f"{pid}:{fields[19]}"] = (int(fields[11]) + int(fields[12]), cmd[:300])
    return seen


def _kind(cmd: str) -> str:
    return next((kind for kind, needle in KINDS if needle in cmd), "other: " + (cmd.split(" ")[0][-40:] or "?"))


def _host_ticks() -> tuple[int, int]:
    """(busy, all) CPU ticks of the host since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def _kdamond() -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("kdamond"):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
                return int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    before, busy0, kd0, start = _snapshot(), _host_ticks(), _kdamond(), time.monotonic()
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen(command)
    seen: dict[str, tuple[int, str]] = {}
    while proc.poll() is None:
        for key, (ticks, cmd) in _snapshot().items():
            if key not in before and ticks >= seen.get(key, (-1, ""))[0]:
                seen[key] = (ticks, cmd or seen.get(key, (0, ""))[1])
        time.sleep(args.every)
    wall, busy1, kd1 = time.monotonic() - start, _host_ticks(), _kdamond()
    by_kind: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for ticks, cmd in seen.values():
        by_kind[_kind(cmd)] += ticks / HZ
        count[_kind(cmd)] += 1
    total = sum(by_kind.values())
    host_busy, host_all = (busy1[0] - busy0[0]) / HZ, (busy1[1] - busy0[1]) / HZ
    print(f"\n{' '.join(command)}: exit {proc.returncode}, wall {wall:.0f} s; the host's CPUs busy {host_busy:.0f} of "
          f"{host_all:.0f} CPU-s ({100 * host_busy / max(host_all, 1):.0f} %); load {load0:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at the end; kdamond {(kd1 - kd0) / HZ:.0f} CPU-s", file=sys.stderr)
    print(f"processes started by it: {total:.0f} CPU-s seen (a floor), by kind:", file=sys.stderr)
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {seconds:7.0f} CPU-s {100 * seconds / max(total, 1):5.1f} %  {count[kind]:4d} processes  {kind}",
              file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
