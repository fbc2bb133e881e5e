"""Where a command's CPU goes, per kind of process: for the suite's time (#34), whose bound is the CPU, not the waits.

    .venv/bin/python scripts/suite_cpu.py -- bash scripts/test.sh -q     # the whole suite, as CI runs it
    .venv/bin/python scripts/suite_cpu.py --tests 20 -- bash scripts/test.sh -q

It runs the command and reads /proc every --every seconds: every process on the machine, its CPU seconds (user +
system, the last reading before it ended; one already running counts from the command's start), its command line,
and the test it ran for (PYTEST_CURRENT_TEST, which a test's subprocesses inherit). The table sums them by kind (a
`gguf-trainer run`, a Dagster code server, Chromium, ...), beside the whole machine's busy and idle CPU seconds over
the same time (/proc/stat): what no reading caught (the kernel's threads, a process shorter than one reading, such as
many a hub child of about 0.2 s) is the difference. Linux only. The exit status is the command's.

A process the tests' warm loader forks (gguf_assets_tests/warm_runs.py) keeps the loader's command line and
environment in /proc, so it names no test there: the tests' side notes each fork's pid and test in the file that
FORK_LOG_ENV names (set here for the command), and its CPU counts to that test.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
YOUNG_READINGS = 8  # a process's command line is read again at each of its first readings (see read_processes)
FORK_LOG_ENV = "SUITE_CPU_FORK_LOG"  # warm_runs.py appends "pid<TAB>start time<TAB>test" a fork
GGUF_TRAINER = re.compile(r"(?:-m gguf_assets\.cli|/gguf-trainer|gguf_assets/cli\.py) (\S+)")


@dataclass
class Seen:
    cpu_s: float       # since the process started, or since the command did for one that was running before it
    command: str
    test: str
    before_s: float = 0.0  # its CPU seconds when the command started (0 for one started since)
    readings: int = 1


def process_kind(command: str) -> str:
    """The kind a command line belongs to, in the words of the suite's processes."""
    if match := GGUF_TRAINER.search(command):
        return f"gguf-trainer {match[1]}"
    if "chrom" in command:
        return "chromium"
    named = (("postgres", "postgres"), ("redis-server", "redis"), ("celery", "celery"),
             ("gguf_assets.lib.materials.hub", "hub child"), ("spare_run", "studio's spare run"),
             ("api grpc", "Dagster code server"), ("gguf_assets.studio.dagster_ui", "Dagster webserver"),
             ("dagster-daemon", "dagster-daemon"), ("gguf_assets.studio.tensorboard", "TensorBoard"),
             ("-m gguf_assets.studio", "studio"), ("multiprocessing", "multiprocessing worker"),
             ("exec(eval(sys.stdin", "pytest-xdist worker"), ("-m pytest", "pytest"), ("/bin/dagster ", "dagster CLI"))
    for needle, kind in named:
        if needle in command:
            return kind
    if match := re.search(r"benchmarks/(\S+)", command):
        return f"benchmark {match[1]}"
    words = command.split()
    if not words:
        return "(no command line: a kernel thread, or gone before its first reading)"
    program = os.path.basename(words[0])
    if len(words) > 1 and words[1] == "-c":
        return f"{program} -c"
    if len(words) > 2 and words[1] == "-m":
        return f"{program} -m {words[2]}"
    if len(words) > 1 and words[1].endswith(".py"):  # a script: its name
        return f"{program} {os.path.basename(words[1])}"
    return program


def machine_cpu_s() -> tuple[float, float]:
    """The machine's busy and idle CPU seconds since boot (/proc/stat's first line)."""
    with open("/proc/stat") as stat:
        ticks = [int(t) for t in stat.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS, (idle + iowait) / CLOCK_TICKS


def _read(pid: str, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def read_processes(seen: dict[tuple[str, str], Seen], skip: int) -> None:
    """One reading of every process: its CPU seconds now, and its command line and test when first seen."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == skip:
            continue
        try:
            stat = _read(pid, "stat").decode(errors="replace")
            fields = stat[stat.rindex(")") + 2:].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
            key = (pid, fields[19])  # a pid with its start time: a reused pid is another process
            known = seen.get(key)
            if known is not None:
                known.cpu_s = max(known.cpu_s, cpu_s)
                known.readings += 1
                if known.readings > YOUNG_READINGS:
                    continue
            # Read again while the process is young: one read between its fork and its exec has its parent's
            # command line and environment. Arguments may hold newlines and tabs (a `python -c` program): one line
            # of single spaces, for --raw.
            command = " ".join(_read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").split())
            test = "-"
            for entry in _read(pid, "environ").split(b"\0"):
                if entry.startswith(b"PYTEST_CURRENT_TEST="):
                    test = entry.split(b"=", 1)[1].decode(errors="replace").split(" ")[0]
            if known is None:
                seen[key] = Seen(cpu_s, command, test)
            elif command:  # (a zombie's is empty)
                known.command, known.test = command, test
        except (OSError, ValueError, IndexError):
            continue  # it ended between the listing and the reading


def attribute_forks(seen: dict[tuple[str, str], Seen], fork_log: str) -> None:
    """The tests of the warm loader's forks, from ``fork_log``'s lines (pid, start time as /proc/PID/stat gives it,
    test)."""
    try:
        with open(fork_log, encoding="utf-8") as log:
            lines = log.read().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        pid, started, test = line.split("\t", 2)
        if (pid, started) in seen:
            seen[(pid, started)].test = test


def idle_by_minute(readings: list[tuple[float, float]]) -> list[float]:
    """The machine's idle CPU seconds in each minute of the command's wall time, from ``(seconds since the start,
    idle CPU seconds since boot)`` readings (the first at the start, the last at the end): where the suite leaves a
    core unused (a long wait with too few other tests beside it, the last tests alone at the end)."""
    minutes: list[float] = []
    for (t0, idle0), (_, idle1) in zip(readings, readings[1:]):
        minute = int(t0 // 60)
        minutes += [0.0] * (minute + 1 - len(minutes))
        minutes[minute] += idle1 - idle0
    return minutes


def report(seen: dict[tuple[str, str], Seen], wall_s: float, busy_s: float, idle_s: float, tests: int,
           idle_minutes: list[float] = ()) -> str:
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_test: dict[str, float] = defaultdict(float)
    for process in seen.values():
        spent = process.cpu_s - process.before_s
        by_kind[process_kind(process.command)].append(spent)
        if process.test != "-":
            by_test[process.test] += spent
    counted = sum(sum(times) for times in by_kind.values())
    lines = [f"wall {wall_s:.0f} s; the machine busy {busy_s:.0f} CPU s, idle {idle_s:.0f} CPU s; "
             f"the processes read: {counted:.0f} CPU s",
             "idle CPU s in each minute: " + " ".join(f"{idle:.0f}" for idle in idle_minutes), "",
             f"{'CPU s':>8} {'share':>6} {'count':>6} {'each':>7}  kind"]
    for kind, times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        total = sum(times)
        if total >= 0.05:
            lines.append(f"{total:8.1f} {100 * total / max(counted, 1e-9):5.1f}% {len(times):6d} "
                         f"{total / len(times):7.2f}  {kind}")
    if tests and by_test:
        lines += ["", f"the {tests} tests whose processes (their own included) took the most CPU:"]
        for test, total in sorted(by_test.items(), key=lambda kv: -kv[1])[:tests]:
            lines.append(f"{total:8.1f}  {test}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.25, help="seconds between readings of /proc (default 0.25)")
    parser.add_argument("--tests", type=int, default=10, help="how many of the costliest tests to list (default 10)")
    parser.add_argument("--raw", metavar="FILE",
                        help="also write every process read, one per line (tab-separated: CPU s, kind, test, "
                             "command line), for a breakdown the table does not give")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- bash scripts/test.sh -q")
    seen: dict[tuple[str, str], Seen] = {}
    read_processes(seen, skip=os.getpid())  # what ran before the command counts from here on
    for process in seen.values():
        process.before_s = process.cpu_s
    busy0, idle0 = machine_cpu_s()
    began = time.monotonic()
    idle_readings = [(0.0, idle0)]
    fork_log = tempfile.NamedTemporaryFile(prefix="suite-cpu-forks-", delete=False)
    fork_log.close()
    try:
        child = subprocess.Popen(command, env={**os.environ, FORK_LOG_ENV: fork_log.name})
        while child.poll() is None:
            read_processes(seen, skip=os.getpid())
            idle_readings.append((time.monotonic() - began, machine_cpu_s()[1]))
            time.sleep(args.every)
        wall = time.monotonic() - began
        busy1, idle1 = machine_cpu_s()
        idle_readings.append((wall, idle1))
        attribute_forks(seen, fork_log.name)
    finally:
        os.unlink(fork_log.name)
    print(report(seen, wall, busy1 - busy0, idle1 - idle0, args.tests, idle_by_minute(idle_readings)),
          file=sys.stderr)
    if args.raw:
        with open(args.raw, "w", encoding="utf-8") as raw:
            for process in sorted(seen.values(), key=lambda p: p.before_s - p.cpu_s):
                raw.write(f"{process.cpu_s - process.before_s:.2f}\t{process_kind(process.command)}\t{process.test}\t"
                          f"{process.command[:300]}\n")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
