"""Run ggk's engine just far enough to read what it computed for a prompt (SD_DUMP_COND), from the command the
product's report gives.

SD_DUMP_COND=<dir> makes the engine write, right after the adapter runs (conditioner.hpp):
    tokens.txt        one token id per line: the whole rendered prompt
    qwen_hidden.bin   raw f32, row-major [L, hidden]: the student's final-norm states (the adapter's input)
    adapter_out.bin   raw f32, row-major [Q, out]: the conditioning
Every conditioning pass overwrites them, so the run keeps to one (--cfg-scale 1: no empty-prompt pass), at the
smallest image and one step (there is no conditioning-only mode; the whole run takes about a second).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gguf_assets.lib.core.ggk_contract import DUMP_ADAPTER_OUT, DUMP_ENV, DUMP_STUDENT_STATES, DUMP_TOKENS

ADAPTER_LINE = re.compile(r"llm adapter: (?P<kind>[^=]+?) in=(?P<in_dim>\d+) out=(?P<out_dim>\d+) "
                          r"width=(?P<width>\d+) depth=(?P<depth>\d+) heads=(?P<heads>\d+) queries=(?P<queries>\d+)")
# One pass, the smallest image, one step: what the dump needs (see the module docstring).
DUMP_ONLY = ["-W", "64", "-H", "64", "--steps", "1", "--cfg-scale", "1", "-s", "42", "-t", "2"]


@dataclass
class Dump:
    tokens: list[int]
    hidden: np.ndarray       # [L, hidden]
    adapter_out: np.ndarray  # [Q, out]
    log: str
    returncode: int


def engine_args(command: str, **fill: str) -> list[str]:
    """The engine's arguments from the report's ``ggk diffuser engine -- ARGS`` line, each ``<placeholder>`` the
    user fills replaced from ``fill`` (by the flag it follows, e.g. diffusion_model="dit.gguf")."""
    words = shlex.split(command)
    if words[:4] != ["ggk", "diffuser", "engine", "--"]:
        raise ValueError(f"not a `ggk diffuser engine -- ...` command: {command!r}")
    args = words[4:]
    for i, word in enumerate(args):
        if word.startswith("<") and word.endswith(">"):
            flag = args[i - 1].lstrip("-").replace("-", "_")
            args[i] = fill.pop(flag)
    if fill:
        raise ValueError(f"nothing to fill for {sorted(fill)} in {command!r}")
    return args


def with_prompt(args: list[str], prompt: str) -> list[str]:
    out = list(args)
    out[out.index("-p") + 1] = prompt
    return out


def run_engine(binary: Path, args: list[str], dump_dir: Path, *, cwd: Path, timeout: float = 120) -> Dump:
    dump_dir.mkdir(parents=True, exist_ok=True)
    for name in (DUMP_TOKENS, DUMP_STUDENT_STATES, DUMP_ADAPTER_OUT):
        (dump_dir / name).unlink(missing_ok=True)
    done = subprocess.run([str(binary), *args, *DUMP_ONLY, "-o", str(dump_dir / "out.png")], cwd=cwd,
                          env={**os.environ, DUMP_ENV: str(dump_dir)}, capture_output=True, text=True,
                          errors="replace", timeout=timeout)
    log = done.stdout + done.stderr
    if not (dump_dir / DUMP_ADAPTER_OUT).is_file():
        raise AssertionError(f"ggk wrote no conditioning (exit {done.returncode}):\n{log[-4000:]}")
    tokens = [int(x) for x in (dump_dir / DUMP_TOKENS).read_text().split()]
    hidden = np.fromfile(dump_dir / DUMP_STUDENT_STATES, dtype="<f4")
    out = np.fromfile(dump_dir / DUMP_ADAPTER_OUT, dtype="<f4")
    line = ADAPTER_LINE.search(log)
    out_dim = int(line["out_dim"]) if line else out.size
    return Dump(tokens, hidden.reshape(len(tokens), -1), out.reshape(-1, out_dim), log, done.returncode)
