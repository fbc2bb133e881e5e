"""Corpus build throughput and peak memory, against plain line reading of the same files.

    .venv/bin/python benchmarks/bench_corpus.py [--prompts 2000000] [--dir /tmp/somewhere]
    .venv/bin/python benchmarks/bench_corpus.py --quick    # 200,000 prompts (the test runs this)

Writes source files holding --prompts prompts (plain .txt, gzip .jsonl, .csv with a named
column, and a .jsonl carrying one 1 MB line; about 5% exact duplicates), then runs, each in
a fresh process so the peaks are separate:
  baseline  read every line of every file (gzip too) and count them, nothing else (best of 3);
  corpus    build_corpus over the same files (clean, dedupe, split, write, hash).
Prints prompts/s and peak RSS of each, and corpus/baseline ratios. Then a tenth of --prompts as a
.json list and as .jsonl (the same prompts, uncompressed) are read through PromptFile, best of 3
each in one process, and the .json / .jsonl time ratio is printed (the .json reader once recounted
newlines from its window's start for every item: 166 s against 1.7 s for 1,000,000 prompts).

The rule (exit status 1 when it fails): the build takes at most 100x the baseline's time
(it measures 13-28x, at 200,000 prompts and at 2,000,000), and its peak RSS over the
baseline process is at most 16 MiB plus 128 bytes per prompt read (it keeps a few fixed-size
numbers per prompt and spills the text to disk: about 80 bytes a prompt at 2,000,000, 115
at 200,000; the prompts themselves held as Python strings would add about 100 bytes each), and
reading the .json list takes at most 3x the .jsonl (it measures 0.7-0.8x; with the recount it was
88x at 20,000 prompts, the --quick size, and 115x at 200,000, the default's).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK_PROMPTS = 200_000
VAL_PROMPTS = 20_000
BUILDS = 2                   # corpus builds, each in a fresh process; the fastest counts
MAX_TIME_RATIO = 100.0       # the build's seconds / the baseline's (measured: 13-28x)
EXTRA_RSS_FLOOR_MIB = 16     # the build's peak RSS over the baseline process: this much ...
EXTRA_RSS_PER_PROMPT = 128   # ... plus this many bytes per prompt read (measured: 80-115)
MAX_JSON_RATIO = 3.0         # reading a .json list / the same prompts as .jsonl (measured: 0.7-0.8x)
WORDS = ("a red fox", "under a bridge", "oil painting", "at dawn", "of a lighthouse", "in the rain",
         "wide angle", "a tiny robot", "with neon lights", "on a wooden table", "cinematic", "watercolor")

BASELINE = """
import gzip, resource, sys, time
import gguf_assets.lib.corpus.corpus  # same imports as the build, so the RSS floors match
best = float("inf")
for _ in range(3):  # the best of three: the reads are short, so one burst of load elsewhere would show
    t = time.perf_counter()
    n = 0
    for name in sys.argv[1:]:
        with (gzip.open(name, "rb") if name.endswith(".gz") else open(name, "rb")) as fh:
            for _ in fh:
                n += 1
    best = min(best, time.perf_counter() - t)
print(n, best, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

BUILD = """
import json, resource, sys, time
from gguf_assets.lib.corpus.corpus import build_corpus
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings, replace
project, train, val, datasets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
settings = replace(Settings(), materials={"student": "x"},
                   corpus={"train_prompts": train, "val_prompts": val, "max_chars": 2000})
t = time.perf_counter()
manifest = build_corpus(ProjectPaths.of(project), settings, MaterialsManifest(datasets=datasets),
                        fingerprint="bench")
elapsed = time.perf_counter() - t
print(json.dumps({"counts": manifest.counts, "seconds": elapsed,
                  "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


READ = """
import sys, time
from pathlib import Path
from gguf_assets.lib.corpus.prompt_files import PromptFile
best = {}
for _ in range(3):  # the best of three, alternating the files, as for the baseline
    for name in sys.argv[1:]:
        t = time.perf_counter()
        n = sum(1 for record in PromptFile(Path(name), "text").records() if type(record) is str)
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
print(n, *(best[name] for name in sys.argv[1:]))
"""


def _prompt(i: int) -> str:
    # About 5% of prompts repeat an earlier one, so deduplication has work to do.
    j = i // 2 if i % 20 == 7 else i
    return f"{WORDS[j % 12]} {WORDS[(j // 12) % 12]} {WORDS[(j // 144) % 12]}, variation {j}"


def write_sources(folder: Path, n: int) -> list[dict]:
    folder.mkdir(parents=True, exist_ok=True)
    parts = [("prompts.txt", 0.4), ("prompts.jsonl.gz", 0.3), ("prompts.csv", 0.2), ("long.jsonl", 0.1)]
    start, datasets = 0, []
    for index, (name, share) in enumerate(parts):
        stop = n if index == len(parts) - 1 else start + int(n * share)
        path = folder / name
        opener = gzip.open(path, "wt", encoding="utf-8", compresslevel=1) if name.endswith(".gz") else \
            open(path, "w", encoding="utf-8")
        with opener as fh:
            if name.endswith(".csv"):
                fh.write("id,text\n")
            for i in range(start, stop):
                text = _prompt(i)
                if name.endswith(".csv"):
                    fh.write(f'{i},"{text}"\n')
                elif ".jsonl" in name:
                    fh.write(json.dumps({"text": text}) + "\n")
                else:
                    fh.write(text + "\n")
            if name == "long.jsonl":
                fh.write(json.dumps({"text": "x" * (1 << 20)}) + "\n")  # read, then dropped for length
        datasets.append({"source": name, "path": str(path), "text_field": "text"})
        start = stop
    return datasets


def write_json_pair(folder: Path, n: int) -> tuple[Path, Path]:
    """The same n prompts as a .json list (one item a line, as json.dump(indent=...) writes it) and as .jsonl."""
    as_json, as_jsonl = folder / "list.json", folder / "list.jsonl"
    texts = [json.dumps({"text": _prompt(i)}) if i % 2 else json.dumps(_prompt(i)) for i in range(n)]
    as_json.write_text("[\n " + ",\n ".join(texts) + "\n]\n", encoding="utf-8")
    as_jsonl.write_text("".join(json.dumps({"text": _prompt(i)}) + "\n" for i in range(n)), encoding="utf-8")
    return as_json, as_jsonl


def _run(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_PROMPTS:,} prompts, a few seconds")
    parser.add_argument("--prompts", type=int, help="prompts in the source files (default 2,000,000)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (QUICK_PROMPTS if args.quick else 2_000_000)
    if args.prompts < 2 * VAL_PROMPTS:
        parser.error(f"--prompts must be at least {2 * VAL_PROMPTS:,} (the val split alone is {VAL_PROMPTS:,})")
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    try:
        t = time.perf_counter()
        datasets = write_sources(scratch / "sources", args.prompts)
        size = sum(Path(d["path"]).stat().st_size for d in datasets)
        print(f"sources: {args.prompts:,} prompts in {len(datasets)} files, {size / 2**20:.0f} MiB on disk "
              f"(written in {time.perf_counter() - t:.1f} s)")

        lines, base_s, base_kib = _run(BASELINE, *(d["path"] for d in datasets)).split()
        base_s, base_kib = float(base_s), int(base_kib)
        val = VAL_PROMPTS
        train = int(args.prompts * 0.85) - val
        # Built BUILDS times, each in a fresh process: the fastest counts, and the highest peak.
        builds = [json.loads(_run(BUILD, str(scratch / "project"), str(train), str(val), json.dumps(datasets)))
                  for _ in range(BUILDS)]
        build = {"counts": builds[0]["counts"], "seconds": min(b["seconds"] for b in builds),
                 "rss_kib": max(b["rss_kib"] for b in builds)}
        counts = build["counts"]
        json_prompts = args.prompts // 10
        read_n, json_s, jsonl_s = _run(READ, *map(str, write_json_pair(scratch / "sources", json_prompts))).split()
        json_s, jsonl_s = float(json_s), float(jsonl_s)
        json_ratio = json_s / jsonl_s
        out_size = sum(p.stat().st_size for p in (scratch / "project" / "corpus").glob("*.jsonl"))

        base_rate, build_rate = args.prompts / base_s, args.prompts / build["seconds"]
        time_ratio = build["seconds"] / base_s
        extra_mib, allowed_mib = (build["rss_kib"] - base_kib) / 1024, rss_allowance_mib(counts["read"])
        print(f"baseline (line reading): {int(lines):,} lines in {base_s:.3f} s = {base_rate:,.0f} prompts/s, "
              f"peak RSS {base_kib / 1024:.1f} MiB")
        print(f"corpus build:            {counts['read']:,} read, {counts['dropped_duplicate']:,} duplicates, "
              f"{counts['dropped_length']:,} too long, {counts['kept']:,} kept; {train:,} train + {val:,} val "
              f"({out_size / 2**20:.0f} MiB written) in {build['seconds']:.3f} s = {build_rate:,.0f} prompts/s, "
              f"peak RSS {build['rss_kib'] / 1024:.1f} MiB")
        print(f"ratios (corpus / baseline): time {time_ratio:.1f}x, "
              f"throughput {build_rate / base_rate:.3f}x, peak RSS {build['rss_kib'] / base_kib:.2f}x "
              f"({extra_mib:+.1f} MiB over the baseline process)")
        print(f"prompt file reading: {int(read_n):,} prompts as a .json list in {json_s:.3f} s, as .jsonl in "
              f"{jsonl_s:.3f} s (best of 3 each); ratio .json / .jsonl {json_ratio:.2f}x")
        ok = time_ratio <= MAX_TIME_RATIO and extra_mib <= allowed_mib and json_ratio <= MAX_JSON_RATIO
        print(f"rule: time ratio {time_ratio:.1f}x <= {MAX_TIME_RATIO:.0f}x and peak RSS over the baseline "
              f"{extra_mib:.1f} MiB <= {allowed_mib:.1f} MiB ({EXTRA_RSS_FLOOR_MIB} MiB + {EXTRA_RSS_PER_PROMPT} B x "
              f"{counts['read']:,} prompts read) and .json / .jsonl reading {json_ratio:.2f}x <= "
              f"{MAX_JSON_RATIO:.0f}x -> {'ok' if ok else 'FAIL'}")
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0 if ok else 1


def rss_allowance_mib(prompts_read: int) -> float:
    return EXTRA_RSS_FLOOR_MIB + EXTRA_RSS_PER_PROMPT * prompts_read / 2**20


if __name__ == "__main__":
    sys.exit(main())
