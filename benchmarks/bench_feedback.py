"""Run -> first training step shown, and Stop -> stopped, as a user sees them on the console (#36 item 4).

A demo project (tiny random-weight models, mock teacher) is built and run once with
``gguf-trainer run DIR``: its shards and a short training. Then ``training.seed`` changes, so the
next Run trains a new run from step 0 on the same shards; that Run is timed from the spawn of
``python -m gguf_assets.cli run DIR``, by the lines it prints (stdout and stderr, as they arrive):

- first line: anything at all (does Run look alive?);
- adapter start: the line that says the new training run starts (training's first note);
- first step: the first ``step N/M`` training line;

then it gets a SIGINT (Ctrl-C) and the time until the process exits is Stop -> stopped; the
console must say it stopped, with the checkpoint step. Baseline, in the same run with the same
interpreter: a bare ``python -c "import torch"``, the floor no run can beat.

``--studio`` times the same Run and Stop clicked in the studio instead (the issue's figure was measured there): the
studio alone (``python -m gguf_assets.studio DIR``, as `gguf-trainer ui` starts it) is opened on the project and
left until its processes are idle (a spare run, where the studio keeps one, has loaded), then Run and Stop are its
``/api/run`` and ``/api/stop``; the lines are the run log's (``.dagster/studio-run.log``) and Stop -> stopped
lasts until the studio's run processes have ended.

``--python PATH`` times another checkout's code with its interpreter (``/work/main/.venv/bin/python``
runs the code at /work/main); ``--before PATH`` also times that one in the same run, so the rule
"the first step is shown in at most half the time it took before" is judged on one machine state.

    .venv/bin/python benchmarks/bench_feedback.py                                    # this checkout
    .venv/bin/python benchmarks/bench_feedback.py --before /work/main/.venv/bin/python   # before/after
    .venv/bin/python benchmarks/bench_feedback.py --quick                            # a quarter-size first run
    .venv/bin/python benchmarks/bench_feedback.py --project DIR                      # Run on a copy of DIR (the test)
    .venv/bin/python benchmarks/bench_feedback.py --studio --before /work/main/.venv/bin/python   # from the studio
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from gguf_assets.lib.demo.demo import QUARTER_SIZES, build_demo_materials, demo_settings
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file

STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\b")
ADAPTER_START = re.compile(r"^\d\d:\d\d:\d\d adapter\s")  # the adapter step's first line (its start)
STOPPED_LINE = re.compile(r"\bstopped\b")
FIRST_LINE_LIMIT_S = 2.0  # rule: Run prints something within this many seconds
STOP_LIMIT_S = 15.0       # rule: Stop -> stopped within this many seconds


def child_env() -> dict:
    dropped = ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT", "GGUF_ASSETS_FAULT", "GGUF_ASSETS_RUN_CHILD", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if k not in dropped}


def import_torch_s(python: str) -> float:
    began = time.perf_counter()
    subprocess.run([python, "-c", "import torch"], check=True, env=child_env())
    return time.perf_counter() - began


def project(root: Path, materials: Path, steps: int, quick: bool = False) -> Path:
    shutil.copytree(materials, root / "materials" / "demo")
    settings = replace(demo_settings(steps=steps, mock_teacher=True),
                       training={"log_every": 10, "checkpoint_every": 20, "validate_every": 20, "batch_size": 8},
                       **(QUARTER_SIZES if quick else {}))  # --quick: the untimed first run gets shorter
    write_project_file(root, settings)
    return root


def first_run(python: str, root: Path) -> float:
    began = time.perf_counter()
    done = subprocess.run([python, "-m", "gguf_assets.cli", "run", str(root)], env=child_env(), cwd=root,
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the first run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - began


def timed_run(python: str, root: Path, timeout_s: float) -> dict:
    """Spawn Run, stamp its lines, Ctrl-C at the first step line, time the stop."""
    lines: list[tuple[float, str]] = []
    began = time.perf_counter()
    child = subprocess.Popen([python, "-m", "gguf_assets.cli", "run", str(root)], env=child_env(), cwd=root,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    first_step = threading.Event()

    def read() -> None:
        for line in child.stdout:
            lines.append((time.perf_counter() - began, line.rstrip("\n")))
            if STEP_LINE.search(line) and not first_step.is_set():
                first_step.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not first_step.wait(timeout_s):
        child.kill()
        raise RuntimeError("no training step line within the time limit:\n" + "\n".join(t for _, t in lines))
    stop_sent = time.perf_counter()
    os.kill(child.pid, signal.SIGINT)
    code = child.wait(timeout=120)
    stopped_s = time.perf_counter() - stop_sent
    reader.join(timeout=10)
    return _timed(lines, stopped_s, code)


def _timed(lines: list[tuple[float, str]], stopped_s: float, code: int | None) -> dict:
    """The figures of a timed Run and Stop, from its console lines (seconds since Run, text)."""
    text = [t for _, t in lines]

    def at(pattern: re.Pattern) -> float | None:
        return next((s for s, t in lines if pattern.search(t)), None)

    said_stopped = any(STOPPED_LINE.search(t) for t in text)
    checkpoint_step = next((int(m.group(1)) for t in reversed(text) if "stopped" in t
                            for m in [re.search(r"step (\d+)", t)] if m), None)
    return {"first_line_s": lines[0][0], "first_line": lines[0][1], "adapter_s": at(ADAPTER_START),
            "first_step_s": at(STEP_LINE), "first_step": next(t for t in text if STEP_LINE.search(t)),
            "stop_s": stopped_s, "code": code, "said_stopped": said_stopped, "checkpoint_step": checkpoint_step,
            "lines": [f"{s:6.2f} s  {t}" for s, t in lines]}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _post(url: str) -> dict:
    request = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def _cpu_s(process: psutil.Process) -> float:
    try:
        return sum(process.cpu_times()[:2])
    except psutil.NoSuchProcess:  # ended meanwhile
        return 0.0


def _wait_ended(processes: list[psutil.Process], timeout_s: float) -> None:
    """Until each has ended: gone, or a zombie (the studio reaps its runs only at the next Run)."""
    def ended(process: psutil.Process) -> bool:
        try:
            return process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + timeout_s
    while not all(ended(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_idle(process: psutil.Process, quiet_s: float = 1.5, limit_s: float = 180) -> None:
    """Until the process and its children use under a fifth of a core for ``quiet_s`` (the studio has loaded what it
    loads ahead)."""
    began, last, quiet_since = time.monotonic(), -1.0, time.monotonic()
    while time.monotonic() - began < limit_s:
        time.sleep(0.25)
        used = sum(_cpu_s(p) for p in [process, *process.children(recursive=True)])
        if used - last > 0.05:  # CPU seconds in this quarter of a second
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        last = used


def studio_timed_run(python: str, root: Path, timeout_s: float) -> dict:
    """Open the studio on the project, let it settle, click Run (/api/run), Stop (/api/stop) at the first step line."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    studio = subprocess.Popen([python, "-m", "gguf_assets.studio", str(root), "--port", str(port)], env=child_env(),
                              cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        began = time.monotonic()
        while True:  # up, and asked for its status as the page asks (which starts a spare run where it keeps one)
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=60).read()
                break
            except OSError:
                if time.monotonic() - began > 120 or studio.poll() is not None:
                    raise RuntimeError("the studio did not answer") from None
                time.sleep(0.25)
        watched = psutil.Process(studio.pid)
        _wait_idle(watched)
        log = root / ".dagster" / "studio-run.log"
        offset = log.stat().st_size if log.exists() else 0
        lines: list[tuple[float, str]] = []
        began = time.perf_counter()
        _post(f"{url}/api/run")
        while not any(STEP_LINE.search(t) for _, t in lines):
            if time.perf_counter() - began > timeout_s:
                raise RuntimeError("no training step line within the time limit:\n" + "\n".join(t for _, t in lines))
            text = log.read_bytes()[offset:].decode(errors="replace") if log.exists() else ""
            for line in text.splitlines()[len(lines):]:
                lines.append((time.perf_counter() - began, line))
            time.sleep(0.02)
        runs = watched.children(recursive=True)
        stop_sent = time.perf_counter()
        _post(f"{url}/api/stop")
        _wait_ended(runs, timeout_s=120)
        stopped_s = time.perf_counter() - stop_sent
        text = log.read_bytes()[offset:].decode(errors="replace")
        for line in text.splitlines()[len(lines):]:
            lines.append((time.perf_counter() - began, line))
    finally:
        studio.terminate()
        studio.wait(timeout=60)
    return _timed(lines, stopped_s, code=None)


def measure(python: str, tmp: Path, materials: Path | None, steps: int, label: str, studio: bool = False,
            quick: bool = False, finished: Path | None = None) -> dict:
    """Time Run and Stop on a project whose shards are done: a demo project run once first, or a copy of
    ``finished`` (a project after a `gguf-trainer run`, which is left as it is)."""
    if finished is not None:
        root, warm_s = tmp / f"project-{label}", None
        shutil.copytree(finished, root, symlinks=True)
    else:
        root = project(tmp / f"project-{label}", materials, steps, quick)
        warm_s = first_run(python, root)
    settings = load_settings(root)
    # A new seed: a new run from step 0 on the same shards (raised steps would go on from the last step, #57).
    write_project_file(root, replace(settings, training={"seed": settings.training.seed + 1}))
    result = studio_timed_run(python, root, timeout_s=600) if studio else timed_run(python, root, timeout_s=600)
    return {**result, "first_run_s": warm_s, "torch_s": import_torch_s(python)}


def report(label: str, python: str, r: dict) -> bool:
    floor = r["torch_s"]
    adapter = "not seen" if r["adapter_s"] is None else f"{r['adapter_s']:.2f} s ({r['adapter_s'] / floor:.1f}x)"
    print(f"{label}: {python}")
    first = "skipped (--project)" if r["first_run_s"] is None else f"{r['first_run_s']:.1f} s"
    print(f"  first run (shards + training) {first}; baseline `import torch` {floor:.2f} s")
    print(f"  first line {r['first_line_s']:.2f} s ({r['first_line_s'] / floor:.2f}x): {r['first_line'][:70]}")
    print(f"  adapter start {adapter}")
    print(f"  first step {r['first_step_s']:.2f} s ({r['first_step_s'] / floor:.1f}x the baseline): "
          f"{r['first_step'][:90]}")
    print(f"  stop -> stopped {r['stop_s']:.2f} s, exit {r['code']}, said stopped: {r['said_stopped']}, "
          f"checkpoint step {r['checkpoint_step']}")
    # From the studio no exit code comes back: its run log says how the run ended.
    ok_stop = (r["said_stopped"] and r["code"] in (130, None) and r["checkpoint_step"] is not None
               and r["stop_s"] < STOP_LIMIT_S)
    print(f"  rule: Stop -> stopped in < {STOP_LIMIT_S:.0f} s, exit 130, says stopped and the step -> "
          f"{'ok' if ok_stop else 'FAIL'}")
    return ok_stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a shorter first run on a quarter of the prompts (the test runs this)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (and so the checkout) to time")
    parser.add_argument("--before", help="another interpreter (checkout) timed in the same run, for the ratio")
    parser.add_argument("--steps", type=int, help="training steps of the first run")
    parser.add_argument("--project", type=Path,
                        help="time Run on a copy of this finished project (its shards done) instead of building and "
                             "running a demo project first; the project itself is not changed")
    parser.add_argument("--verbose", action="store_true", help="print the timed run's console lines")
    parser.add_argument("--studio", action="store_true", help="click Run and Stop in the studio, not on the console")
    args = parser.parse_args(argv)
    steps = args.steps or (20 if args.quick else 60)
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-feedback-") as tmp:
        materials = None
        if args.project is None:
            materials = Path(tmp) / "demo-materials"
            build_demo_materials(materials, seed=0, **({"n_prompts": 600} if args.quick else {}))
        runs = [("after", args.python)] + ([("before", args.before)] if args.before else [])
        results = {}
        for label, python in runs:
            results[label] = r = measure(python, Path(tmp), materials, steps, label, studio=args.studio,
                                         quick=args.quick, finished=args.project)
            if args.verbose:
                print("\n".join(f"    | {t}" for t in r["lines"]))
            ok &= report(label, python, r)
            if label == "after":
                ok_first = r["first_line_s"] < FIRST_LINE_LIMIT_S
                print(f"  rule: the first line within {FIRST_LINE_LIMIT_S:.0f} s -> {'ok' if ok_first else 'FAIL'}")
                ok &= ok_first
        if "before" in results:
            a, b = results["after"], results["before"]
            ratio = a["first_step_s"] / b["first_step_s"]
            # Each run against its own `import torch` floor too: a neighbour's load slows one run more than the other.
            floored = (a["first_step_s"] / a["torch_s"]) / (b["first_step_s"] / b["torch_s"])
            print(f"ratio after/before: first step {ratio:.2f}x ({a['first_step_s']:.1f} s vs "
                  f"{b['first_step_s']:.1f} s; {floored:.2f}x in multiples of each run's import-torch floor), "
                  f"first line {a['first_line_s'] / b['first_line_s']:.2f}x, stop {a['stop_s'] / b['stop_s']:.2f}x")
            halved = ratio <= 0.5 and floored <= 0.5
            print(f"rule: the first step shown in at most half the time of before, in seconds and in floors -> "
                  f"{'ok' if halved else 'FAIL'}")
            ok &= halved
    if not ok:
        print("FAIL: a rule above does not hold", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
