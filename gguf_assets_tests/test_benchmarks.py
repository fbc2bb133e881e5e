"""The benchmark scripts run, at their small sizes, and their own pass/fail criteria hold."""

import math
import os
import re
from pathlib import Path

import pytest
from warm_runs import script_run

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _run(script: str, *args: str, timed_rules: bool = False) -> str:
    """The benchmark's output. With ``timed_rules`` its rules compare timings, so a busy neighbour (the other test
    worker) may fail one: exit 1 is then accepted, and the test checks that each verdict follows from the printed
    figures (speed is judged by running the benchmark, not by the suite, which runs beside other work). The script
    runs in a process forked by this test process's warm loader where it can (warm_runs.py: it starts as a cold
    `python SCRIPT` does, without loading torch, transformers and Dagster again)."""
    done = script_run(BENCHMARKS / script, list(args), env=dict(os.environ), capture_output=True, text=True,
                      timeout=600)
    failed = any(re.fullmatch(r"(rule: )?.* -> FAIL", line.strip()) for line in done.stdout.splitlines())
    expected = 1 if timed_rules and failed else 0
    assert done.returncode == expected, done.stdout + done.stderr
    return done.stdout


def _follows(verdict: str, *checks: tuple[float, str, float, float]) -> None:
    """``verdict`` ("ok" or "FAIL") is what the rule's checks give: each (value, op, limit, unit), with op "<=", "<"
    or ">=", and value and limit printed to ``unit``; a check within a printed unit of its limit may go either way."""
    def holds(value: float, op: str, limit: float, slack: float) -> bool:
        return value <= limit + slack if op in ("<=", "<") else value >= limit - slack

    surely = all(holds(v, op, lim, -unit) for v, op, lim, unit in checks)
    maybe = all(holds(v, op, lim, unit) for v, op, lim, unit in checks)
    assert (verdict == "ok") if surely else (verdict == "FAIL") if not maybe else verdict in ("ok", "FAIL"), (
        verdict, checks)


NUMBER = r"[-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?"  # what the benchmarks print: 1,234  0.931  +7.0  7.48e-07


def _regex(pattern: str) -> str:
    """``pattern`` as a regex: ``#`` stands for a number, a space for one or more."""
    return re.escape(pattern).replace(re.escape("#"), f"({NUMBER})").replace(r"\ ", " +")


def _figures(out: str, pattern: str) -> list[float]:
    """The numbers of the one printed line that matches ``pattern`` (``#`` stands for a number), all finite."""
    regex = _regex(pattern)
    found = [m for m in (re.fullmatch(regex, line.strip()) for line in out.splitlines()) if m]
    assert len(found) == 1, f"expected one line like {pattern!r}:\n{out}"
    values = [float(x.replace(",", "")) for x in found[0].groups()]
    assert all(math.isfinite(v) for v in values), (pattern, values)
    return values


def _verdict(out: str, pattern: str) -> tuple[list[float], str]:
    """The figures of the rule line (``pattern`` without the verdict) and its verdict, "ok" or "FAIL". A benchmark
    may print several rule lines, each with its own verdict."""
    for verdict in ("ok", "FAIL"):
        if any(re.fullmatch(_regex(f"{pattern} -> {verdict}"), line.strip()) for line in out.splitlines()):
            return _figures(out, f"{pattern} -> {verdict}"), verdict
    raise AssertionError(f"no rule line:\n{out}")


def _quotient_ok(q: float, a: float, b: float, *, unit_a: float, unit_b: float, unit_q: float) -> bool:
    """q, printed to unit_q, is a / b for some a and b within half a printed unit of what was printed."""
    low = (a - unit_a / 2) / (b + unit_b / 2)
    high = (a + unit_a / 2) / (b - unit_b / 2)
    return low - unit_q / 2 - 1e-12 <= q <= high + unit_q / 2 + 1e-12


@pytest.mark.slow  # about 2 CPU s: builds shards and times status against hashing them
def test_status_reads_under_one_percent_of_the_shard_bytes():
    """bench_status.py --quick: status reads records, never shard data."""
    out = _run("bench_status.py", "--quick")
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [20, 80]
    assert all(float(r[3].rstrip("%")) < 1.0 for r in rows), out
    load_ms, python_ms, ratio = _figures(out, "project.yaml load: # ms; with the pure-Python YAML loader # ms; ratio #")
    assert load_ms > 0 and _quotient_ok(ratio, load_ms, python_ms, unit_a=0.01, unit_b=0.01, unit_q=0.001), out


# Not `serial`: its CPU seconds are this process's own, and the test checks that the verdict follows from the
# printed table, whatever a busy neighbour does to the figures.
@pytest.mark.slow  # about 12 CPU s: four families built and trained, 4 steps a run
def test_quality_benchmark_prints_its_table_and_applies_its_own_rule():
    """bench_quality.py --quick: every variant on the four families, deltas against the same run's base
    row, and verdict lines that follow from the table by #27's rule (>= 0.01 on each independent family,
    C and D, within the seed-to-seed spread on A and B, at equal CPU time)."""
    out = _run("bench_quality.py", "--quick")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["pair", "variant"])
    rows = []
    for line in lines[header + 1:]:
        parts = line.split()
        if len(parts) != 8 or parts[0] not in ("A", "B", "C", "D"):
            break
        pair, variant, steps, cpu, ratio, cosine, delta, base = parts
        rows.append({"pair": pair, "variant": variant, "steps": int(steps), "cpu": float(cpu), "ratio": float(ratio),
                     "cosine": float(cosine), "delta": float(delta), "base": base})
    # Every family reads the student's final norm, the only states ggk feeds the adapter: no student-layer rows.
    expected = [(p, v) for p in "ABCD" for v in ["current", "current-seed1", "current-seed2", "pre-ggk-adapter",
                                                "isotropic", "relational-0.1", "relational-0.3", "select-random",
                                                "select-clusters", "select-farthest"]]
    assert [(r["pair"], r["variant"]) for r in rows] == expected, out
    by = {(r["pair"], r["variant"]): r for r in rows}
    for r in rows:
        assert r["base"] == ("select-random" if r["variant"] in ("select-clusters", "select-farthest") else "current")
        assert r["steps"] >= 1 and r["cpu"] > 0 and -1.0 <= r["cosine"] <= 1.0, r
        assert abs(r["delta"] - (r["cosine"] - by[(r["pair"], r["base"])]["cosine"])) <= 2e-4, r
        cpu, b = r["cpu"], by[(r["pair"], "current")]["cpu"]  # both printed to 0.01 s, the ratio to 0.01
        assert (cpu - 0.005) / (b + 0.005) - 0.005 <= r["ratio"] <= (cpu + 0.005) / (b - 0.005) + 0.005, r
    assert all(by[(p, "current")]["delta"] == 0.0 and by[(p, "current")]["ratio"] == 1.0 for p in "ABCD")
    spread = {p: max(abs(by[(p, f"current-seed{k}")]["delta"]) for k in (1, 2)) for p in "ABCD"}
    assert _figures(out, "seed-to-seed spread: A #, B #, C #, D #") == pytest.approx([spread[p] for p in "ABCD"],
                                                                                 abs=1e-4)
    for p in "ABCD":  # the pre-#55 adapter (a reference row, never adopted) against current, at the same steps
        new, old = by[(p, "current")], by[(p, "pre-ggk-adapter")]
        assert old["steps"] == new["steps"], old
        figures = _figures(out, f"pre-ggk baseline, pair {p}: val centred cosine current #, pre-ggk-adapter #, "
                                "current - pre-ggk # (seed spread #); CPU s current #, pre-ggk-adapter # at "
                                "# steps each")
        assert figures == pytest.approx([new["cosine"], old["cosine"], -old["delta"], spread[p], new["cpu"],
                                         old["cpu"], new["steps"]], abs=2e-4), (p, figures)

    def winners(slack: float) -> set[str]:
        """The rule with every threshold moved by ``slack`` (> 0: easier): printing precision either way."""
        found = set()
        for (pair, name) in by:
            if pair != "C" or name in ("current", "current-seed1", "current-seed2", "pre-ggk-adapter", "select-random"):
                continue
            new, others = [by[(p, name)] for p in "CD"], [by[(p, name)] for p in "AB" if (p, name) in by]
            if (all(r["delta"] >= 0.01 - slack for r in new)
                    and all(r["delta"] >= -spread[r["pair"]] - slack for r in others)
                    and all(r["ratio"] <= 1.10 + 10 * slack for r in [*new, *others])):
                found.add(name)
        return found

    for pair in "ABCD":  # the teachers depend on the prompt more than on its word order, and on both
        shuffled, different = _figures(out, f"teacher order, pair {pair}: a val prompt's targets vs its words "
                                            "shuffled, centred cosine # (two different prompts: #)")
        assert different < shuffled < 0.999, (pair, shuffled, different)
    verdicts = lines[header + 1 + len(rows) + 1:]
    named = {line.split()[1] for line in verdicts if line.startswith("winner: ")}
    if named:
        assert winners(-2e-4) <= named <= winners(2e-4), out
    else:
        assert any(line.startswith("no variant gains >= 0.01 on C and D") for line in verdicts), out
        assert not winners(-2e-4), out


@pytest.mark.slow  # about 4 CPU s: one family built, 32 runs of 4 steps
def test_quality_study_prints_every_row_with_its_retrieval_and_its_delta():
    """bench_quality.py --study --quick (#68): per seed, the product, the minimal resampler, the per-(row, dim) mark
    and each change, in that order, each with its val centred cosine, its delta against the product of the same
    seed and prompt retrieval; the targets' line; and each row's mean delta over the seeds."""
    out = _run("bench_quality.py", "--study", "--quick", "--pairs", "A", "--seeds", "0,1")
    share, lowest, floor, floored, values, empty, train = _figures(
        out, "targets, pair A: the query rows' means carry #% of the variance; per-(row, dim) std from # "
             "(sigma_floor # floors # of #); # empty of # train prompts")
    assert 0 < share < 100 and lowest > 0 and floor == 0.01 and 0 <= floored <= values and 0 < empty < train, out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["pair", "variant"])
    names = ["product", "minimal-per-dim", "mark-per-row-dim", "init-row-means", "query-lr-x10", "query-lr-x30",
             "cpu-start", "sigma-floor-0.2", "isotropic", "no-empty-prompts", "cosine-weight-0", "grad-clip-off",
             "grad-clip-10", "cpu-start-no-clip", "weight-decay-0", "ema-0.999"]
    rows = [line.split() for line in lines[header + 1:header + 1 + 2 * len(names)]]
    assert [(r[0], r[1], int(r[2])) for r in rows] == [("A", n, seed) for seed in (0, 1) for n in names], out
    by = {(r[1], int(r[2])): [float(x) for x in r[3:]] for r in rows}
    for (name, seed), (steps, cosine, delta, top1, top5, margin) in by.items():
        assert steps == 4 and -1 <= cosine <= 1 and abs(delta - (cosine - by[("product", seed)][1])) <= 2e-4, name
        assert 0 <= top1 <= top5 <= 1 and -2 <= margin <= 2, name
    spread = _figures(out, "pair A, seeds 0, 1: the product's seed-to-seed spread #")[0]
    assert spread == pytest.approx(abs(by[("product", 1)][1] - by[("product", 0)][1]), abs=2e-4)
    for name in names[1:]:
        mean, low, high = _figures(out, f"{name}: mean delta # (min #, max #)")
        deltas = [by[(name, seed)][2] for seed in (0, 1)]
        assert [mean, low, high] == pytest.approx([sum(deltas) / 2, min(deltas), max(deltas)], abs=2e-4), name


@pytest.mark.slow  # about 3 s: 200,000 prompts written, read 3 times, built twice; 20,000 read as .json and .jsonl
def test_corpus_benchmark_prints_its_ratios_and_applies_its_own_rule():
    """bench_corpus.py --quick: the build against plain line reading, time and peak RSS, a .json list read
    against the same prompts as .jsonl, and a rule line (time ratio, RSS over the baseline and the .json / .jsonl
    ratio bounded) that follows from the printed figures."""
    out = _run("bench_corpus.py", "--quick", timed_rules=True)
    prompts, files, _, _ = _figures(out, "sources: # prompts in # files, # MiB on disk (written in # s)")
    lines, base_s, base_rate, base_rss = _figures(
        out, "baseline (line reading): # lines in # s = # prompts/s, peak RSS # MiB")
    read, duplicates, too_long, kept, train, val, _, build_s, build_rate, build_rss = _figures(
        out, "corpus build: # read, # duplicates, # too long, # kept; # train + # val (# MiB written) in # s "
             "= # prompts/s, peak RSS # MiB")
    time_ratio, throughput, rss_ratio, extra = _figures(
        out, "ratios (corpus / baseline): time #x, throughput #x, peak RSS #x (# MiB over the baseline process)")
    assert files == 4 and lines >= read >= prompts > 0, out
    assert 0 < duplicates and kept + duplicates + too_long <= read and 0 < train + val <= kept, out
    assert min(base_s, base_rate, base_rss, build_s, build_rate, build_rss) > 0, out
    assert math.isclose(base_rate, prompts / base_s, rel_tol=0.02) and math.isclose(build_rate, prompts / build_s,
                                                                                    rel_tol=0.02), out
    assert _quotient_ok(time_ratio, build_s, base_s, unit_a=1e-3, unit_b=1e-3, unit_q=0.1), out
    assert _quotient_ok(throughput, base_s, build_s, unit_a=1e-3, unit_b=1e-3, unit_q=1e-3), out
    assert _quotient_ok(rss_ratio, build_rss, base_rss, unit_a=0.1, unit_b=0.1, unit_q=0.01), out
    assert abs(extra - (build_rss - base_rss)) <= 0.15, out
    json_prompts, json_s, jsonl_s, json_ratio = _figures(
        out, "prompt file reading: # prompts as a .json list in # s, as .jsonl in # s (best of 3 each); "
             "ratio .json / .jsonl #x")
    assert json_prompts == prompts // 10 and min(json_s, jsonl_s) > 0, out
    assert _quotient_ok(json_ratio, json_s, jsonl_s, unit_a=1e-3, unit_b=1e-3, unit_q=0.01), out

    (rule_ratio, max_ratio, rule_extra, allowed, floor, per_prompt, rule_read, rule_json, max_json), verdict = \
        _verdict(out, "rule: time ratio #x <= #x and peak RSS over the baseline # MiB <= # MiB (# MiB + # B x # "
                      "prompts read) and .json / .jsonl reading #x <= #x")
    assert (rule_ratio, rule_extra, rule_read, rule_json) == (time_ratio, extra, read, json_ratio), out
    assert abs(allowed - (floor + per_prompt * read / 2**20)) <= 0.05, out
    _follows(verdict, (rule_ratio, "<=", max_ratio, 0.1), (rule_extra, "<=", allowed, 0.1),
             (rule_json, "<=", max_json, 0.01))
    assert rule_extra <= allowed, out  # memory, unlike time, does not depend on the neighbours


@pytest.mark.slow  # about 2 CPU s: three exports of the 81 MB adapter, a small adapter evaluated both ways
def test_export_benchmark_prints_its_ratios_and_applies_its_own_rule():
    """bench_export.py --quick: export against a raw atomic write, the numpy evaluator against torch,
    and a rule line (both ratios bounded, the scores agreeing) that follows from the printed figures; the export
    with its f16 check against the write alone, the check measured without a record, and their rule line."""
    out = _run("bench_export.py", "--quick", timed_rules=True)
    mb, export_s, raw_s, rounds = _figures(
        out, "export: # MB GGUF in # s; raw atomic write of the same bytes # s (best of # alternated rounds)")
    median, q1, q3, best, export_rate, raw_rate = _figures(
        out, "ratio export / raw write = #x median over rounds (quartiles #x-#x; best vs best #x; "
             "# MB/s vs # MB/s)")
    n, shards, numpy_s, numpy_rate, torch_s, torch_rate = _figures(
        out, "evaluation on # val prompts (# shards): numpy GGUF # s (# prompts/s), torch checkpoint # s "
             "(# prompts/s)")
    (eval_ratio,) = _figures(out, "ratio numpy / torch = #x")
    numpy_cos, torch_cos, difference = _figures(out, "val centred cosine: numpy #, torch #, difference #")
    assert min(mb, export_s, raw_s, median, q1, best, export_rate, raw_rate, numpy_s, torch_s) > 0, out
    assert rounds >= 3 and n >= shards >= 1 and q1 <= median <= q3, out
    assert _quotient_ok(best, export_s, raw_s, unit_a=1e-3, unit_b=1e-3, unit_q=0.01), out
    assert _quotient_ok(export_rate, mb, export_s, unit_a=0.1, unit_b=1e-3, unit_q=1), out
    assert _quotient_ok(raw_rate, mb, raw_s, unit_a=0.1, unit_b=1e-3, unit_q=1), out
    assert _quotient_ok(numpy_rate, n, numpy_s, unit_a=0, unit_b=1e-3, unit_q=0.1), out
    assert _quotient_ok(torch_rate, n, torch_s, unit_a=0, unit_b=1e-3, unit_q=0.1), out
    assert _quotient_ok(eval_ratio, numpy_s, torch_s, unit_a=1e-3, unit_b=1e-3, unit_q=0.01), out
    assert -1 <= numpy_cos <= 1 and -1 <= torch_cos <= 1 and difference >= 0, out
    assert abs(abs(numpy_cos - torch_cos) - difference) <= 1e-6, out

    (rule_median, max_export, rule_eval, max_eval, rule_difference, agreement), verdict = _verdict(
        out, "rule: export / raw write #x <= #x and numpy / torch #x <= #x and difference # < #")
    assert (rule_median, rule_eval, rule_difference) == (median, eval_ratio, difference), out
    _follows(verdict, (median, "<=", max_export, 0.01), (eval_ratio, "<=", max_eval, 0.01))
    assert difference < agreement, out  # the scores agree whatever the load: not a timing

    width, depth, rows, dim, student_dim, _ = _figures(
        out, "f16 check at width #, depth # (Q #, D #, student dim #): #M values")
    prompts, shards = _figures(out, "val prompts: #, shards: #")
    write_s, check_s, rounds = _figures(out, "write alone: # s; export with its f16 check: # s (best of #)")
    check_median, median_rounds = _figures(out, "ratio export with f16 check / write alone = #x median over # rounds")
    measure_s, measured, per_prompt, _ = _figures(
        out, "measuring without a record: # s for # prompts (# s a prompt, best of #)")
    whole_s, whole_prompts, whole_ratio = _figures(out, "so about # s for # prompts: #x the write alone")
    (share,) = _figures(out, "recording the peaks in a validation: # % of its forward (profiled)")
    assert min(width, depth, rows, dim, student_dim, write_s, check_s, measure_s) > 0 and rounds == median_rounds, out
    assert whole_prompts == prompts >= measured >= 1 and shards >= 1 and 0 <= share < 100, out
    assert _quotient_ok(per_prompt, measure_s, measured, unit_a=1e-3, unit_b=0, unit_q=1e-4), out
    assert abs(whole_s - (write_s + per_prompt * prompts)) <= 0.05 + 5e-5 * prompts, out
    assert _quotient_ok(whole_ratio, whole_s, write_s, unit_a=0.1, unit_b=1e-3, unit_q=0.1), out
    (rule_check, max_check), verdict = _verdict(out, "rule: export with its f16 check / write alone #x <= #x")
    assert rule_check == check_median, out
    _follows(verdict, (check_median, "<=", max_check, 0.01))


@pytest.mark.slow  # about 5 CPU s: the demo teacher over 48 length-skewed prompts, naive and packed, once; an 8-layer
def test_precompute_benchmark_prints_its_ratios_and_applies_its_own_rule():  # one over 16 prompts, read at layer 2
    """bench_precompute.py --quick: packed against naive batches and the whole pipeline against its own
    forwards, and a rule line (speedup, padding gain, overhead) that follows from the printed figures; a middle-layer
    teacher against the whole model's forward, and its rule line (speedup, the same states)."""
    out = _run("bench_precompute.py", "--quick", timed_rules=True)
    n, long, shortest, median, longest, truncated, q, batch, budget = _figures(
        out, "prompts: # (# long), text tokens: min #, median #, max #, truncated #; Q = #; teacher_batch #, "
             "token_budget #; device cpu; torch threads #")[:9]
    assert n > long > 0 and 0 < shortest <= median <= longest and truncated == 0 and q > 0, out
    rows = {}
    for name, label in (("naive", "naive fixed batches (original order):"), ("packed", "token-budget packing:")):
        batches, seconds, rate, efficiency = _figures(out, f"{label} # batches, # s, # prompts/s, padding "
                                                           "efficiency #")
        assert batches >= math.ceil(n / batch) and seconds > 0 and 0 < efficiency <= 1, out
        assert _quotient_ok(rate, n, seconds, unit_a=0, unit_b=1e-3, unit_q=0.01), out
        rows[name] = {"seconds": seconds, "efficiency": efficiency}
    pipeline_s, pipeline_rate, tokens_rate = _figures(
        out, "whole pipeline (teacher half, packed): # s, # prompts/s, # text tokens/s")
    assert pipeline_s > 0 and tokens_rate > 0 and _quotient_ok(pipeline_rate, n, pipeline_s, unit_a=0, unit_b=1e-3,
                                                               unit_q=0.01), out
    speedup, target_speedup = _figures(out, "packing speedup vs naive: #x (target >= #x)")
    (end_to_end,) = _figures(out, "end-to-end speedup vs naive forwards: #x")
    efficiency, _ = _figures(out, "padding efficiency (packed): # (target >= #)")
    overhead, _, before_writes = _figures(
        out, "pipeline overhead vs its own forwards: # % (target <= # %; # % before the disk writes)")
    _figures(out, "pipeline vs separately timed forwards: # % (includes load from other processes between the runs)")
    assert _quotient_ok(speedup, rows["naive"]["seconds"], rows["packed"]["seconds"], unit_a=1e-3, unit_b=1e-3,
                        unit_q=0.01), out
    assert _quotient_ok(end_to_end, rows["naive"]["seconds"], pipeline_s, unit_a=1e-3, unit_b=1e-3, unit_q=0.01), out
    assert efficiency == rows["packed"]["efficiency"] and before_writes <= overhead + 0.1, out

    (rule_speedup, min_speedup, gain, min_gain, rule_overhead, max_overhead), verdict = _verdict(
        out, "rule: packing speedup #x >= #x and padding efficiency packed / naive #x >= #x and pipeline overhead "
             "# % <= # %")
    assert (rule_speedup, rule_overhead, min_speedup) == (speedup, overhead, target_speedup), out
    assert _quotient_ok(gain, rows["packed"]["efficiency"], rows["naive"]["efficiency"], unit_a=1e-3, unit_b=1e-3,
                        unit_q=0.01), out
    _follows(verdict, (speedup, ">=", min_speedup, 0.01), (gain, ">=", min_gain, 0.01),
             (overhead, "<=", max_overhead, 0.1))
    assert gain >= min_gain, out  # padding is counted, not timed

    # The middle-layer teacher (#58): only the blocks below the layer read, against the whole model's forward.
    layers, layer, n_mid, mid_batches = _figures(
        out, "middle-layer teacher: # layers read at layer #, # prompts in # packed batches")
    assert 0 < layer < layers and n_mid == 16 and mid_batches >= 2, out
    mid = {}
    for name, label in (("before", "whole model, every layer's output kept (before):"),
                        ("after", "only the blocks below the layer (after):")):
        seconds, rate, weights, held = _figures(out, f"{label} # s, # prompts/s, weights # MiB, layer outputs held "
                                                     "# MiB")
        assert seconds > 0 and _quotient_ok(rate, n_mid, seconds, unit_a=0, unit_b=1e-3, unit_q=0.01), out
        mid[name] = {"seconds": seconds, "weights": weights, "held": held}
    # Counted, not timed: fewer blocks' weights, and one layer's output held instead of every layer's.
    assert mid["after"]["weights"] < mid["before"]["weights"], out
    assert mid["before"]["held"] == pytest.approx((layers + 1) * mid["after"]["held"], abs=0.05), out
    mid_speedup, mid_target, relative = _figures(
        out, "middle-layer speedup: #x (target >= #x); states read differ by at most # of their largest |value|")
    assert _quotient_ok(mid_speedup, mid["before"]["seconds"], mid["after"]["seconds"], unit_a=1e-3, unit_b=1e-3,
                        unit_q=0.01), out
    assert relative == 0, out  # on the CPU the states read are the same bits: not a timing
    (rule_mid_speedup, min_mid_speedup, rule_relative, max_relative), mid_verdict = _verdict(
        out, "rule: middle-layer speedup #x >= #x and relative difference # <= #")
    assert (rule_mid_speedup, min_mid_speedup, rule_relative, max_relative) == (mid_speedup, mid_target, 0, 0), out
    _follows(mid_verdict, (mid_speedup, ">=", min_mid_speedup, 0.01))


@pytest.mark.slow  # about 9 CPU s: peak RSS streaming 2 and 20 shards, 3 rounds of 40 trainer and bare-loop steps
def test_train_benchmark_prints_its_ratios_and_applies_its_own_rule():
    """bench_train.py --quick: streaming RSS 10x against 1x, the trainer against a bare loop, the reader
    against raw reads, and a rule line that follows from the printed figures."""
    import torch

    from gguf_assets.lib.training.precision import native_bf16, step_precision

    out = _run("bench_train.py", "--quick", timed_rules=True)
    prompts, shard_mb, one, ten, _ = _figures(out, "shards: # prompts, # MB each; 1x = #, 10x = #; torch threads #")
    assert prompts > 0 and shard_mb > 0 and ten == 10 * one > 0, out
    rss1, read1, rss10, read10, rss_ratio, target_rss, windows1, windows10 = _figures(
        out, "peak RSS streaming 1.25 epochs: 1x # MB (# MB read), 10x # MB (# MB read) -> ratio # (target <= #); "
             "windows in memory at once: # and #")
    assert min(rss1, rss10, windows1, windows10) > 0 and read10 > read1 > 0, out
    assert _quotient_ok(rss_ratio, rss10, rss1, unit_a=1, unit_b=1, unit_q=1e-3), out
    steps_line = next(line for line in out.splitlines() if line.startswith("steps/s: "))
    head, rounds_text = steps_line.split("; rounds (trainer, bare) ")
    trainer, bare, overhead, overhead_median, _ = _figures(
        head, "steps/s: trainer (real reader) #, bare loop over in-memory batches # -> overhead best-vs-best #%, "
              "median of rounds #% (target <= #%)")
    rounds = [tuple(float(x) for x in pair) for pair in re.findall(rf"\(({NUMBER}), ({NUMBER})\)", rounds_text)]
    assert len(rounds) == 3 and all(a > 0 and b > 0 for a, b in rounds), out
    assert (trainer, bare) == (max(a for a, _ in rounds), max(b for _, b in rounds)), out
    assert _quotient_ok(1 + overhead / 100, bare, trainer, unit_a=0.01, unit_b=0.01, unit_q=1e-3), out
    per_round = sorted(b / a - 1 for a, b in rounds)  # the rounds are printed to 0.01 steps/s
    assert abs(overhead_median / 100 - per_round[len(per_round) // 2]) <= 0.005, out
    reader, raw, mb, reader_ratio = _figures(
        out, "reader, page cache evicted: read_torch # MB/s, raw sequential reads # MB/s over # MB -> ratio # "
             "(the reference pace needs about 200 MB/s)")[:4]
    assert min(reader, raw, mb) > 0 and _quotient_ok(reader_ratio, reader, raw, unit_a=1, unit_b=1, unit_q=0.01), out
    shared_ms, per_prompt_ms, speedup = _figures(
        out, "demo-shaped step: query rows shared by the batch # ms, copied per prompt # ms -> speedup #x")
    assert min(shared_ms, per_prompt_ms) > 0, out
    assert _quotient_ok(speedup, per_prompt_ms, shared_ms, unit_a=0.1, unit_b=0.1, unit_q=0.01), out
    bf16_line = next(line for line in out.splitlines() if line.startswith("demo-shaped step: bf16 autocast "))
    bf16_ms, fp32_ms, bf16_speedup = _figures(bf16_line.split(" (bf16 hardware")[0],
                                              "demo-shaped step: bf16 autocast # ms, f32 # ms -> speedup #x")
    assert min(bf16_ms, fp32_ms) > 0, out
    assert _quotient_ok(bf16_speedup, fp32_ms, bf16_ms, unit_a=0.1, unit_b=0.1, unit_q=0.01), out
    # The hardware it names and the choice it prints are the trainer's own for the demo's shape.
    cpu = torch.device("cpu")
    hardware, auto = native_bf16(cpu), step_precision("auto", cpu, work=16 * 256 * 128)
    assert bf16_line.endswith(f"(bf16 hardware: {hardware or 'none, emulated'}; training.precision auto picks "
                              f"{auto} here)"), bf16_line

    (rule_rss, max_rss, rule_overhead, max_overhead, rule_reader, min_reader), verdict = _verdict(
        out, "rule: peak RSS ratio # <= # and trainer overhead best-vs-best #% <= #% and reader / raw # >= #")
    assert (rule_rss, max_rss, rule_overhead, rule_reader) == (rss_ratio, target_rss, overhead, reader_ratio), out
    _follows(verdict, (rss_ratio, "<=", max_rss, 1e-3), (overhead, "<=", max_overhead, 0.1),
             (reader_ratio, ">=", min_reader, 0.01))
    assert rss_ratio <= max_rss, out  # memory, unlike time, does not depend on the neighbours


@pytest.mark.slow
def test_gpu_check_passes_on_cpu_at_its_tiny_size():
    """gpu_check.py --tiny: the checks that need CUDA say SKIP, every other one passes."""
    out = _run("gpu_check.py", "--tiny")
    status = {line[6:32].strip(): line[:4] for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}
    assert "FAIL" not in status.values(), out
    for name in ("environment", "precompute sequential", "bf16 student states", "training 64 x 1",
                 "GGUF agrees with torch"):
        assert status[name] == "PASS", out
    if "cuda" not in out.splitlines()[0]:
        assert status["precompute balanced"] == status["out-of-memory auto-lower"] == "SKIP", out
        assert status["every GPU (--workers auto)"] == "SKIP" and "skipped: 0 GPU(s)" in out, out


@pytest.mark.slow  # about 25 CPU s: a pipeline of 60 prompts (a cold run), two webservers, 100 synthetic partitions
def test_scale_benchmark_prints_every_stage_and_part_and_applies_its_rules():
    """bench_scale.py --quick: per stage wall and peak RSS, the per-partition overhead, status and GraphQL
    times, then the same at synthetic partitions. Its cluster part (Postgres, Redis, Celery workers) is left to the
    full benchmark: the suite runs the whole pipeline on those servers in test_cluster_workers.py already."""
    out = _run("bench_scale.py", "--quick", "--part", "pipeline", "partitions")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split() and line.split()[0] in ("materials", "corpus", "train_shards", "val_shards", "adapter",
                                                      "gguf", "eval_report")}
    assert len(rows) == 7 and all(float(rss) > 0 for _, rss in rows.values()), out
    assert float(rows["train_shards"][0]) > 0 and float(rows["adapter"][0]) > 0, out
    wall, partitions, compute, overhead = _figures(
        out, "whole `run`: # s; shard partitions: #, shard compute # s; per partition on top of its compute: # s")
    # 40 train prompts at 20 a shard, and 1 val shard; the orchestration cost fits in the run's wall time.
    assert partitions == 2 + 1 and 0 < compute < wall and 0 <= overhead * partitions < wall, out
    assert "rule: the UI lists all 2 train partitions materialized -> ok" in out, out
    assert "(100/100)" in out and "-> FAIL" not in out, out
    assert "## cluster" not in out and out.count("rule: ") == 2, out


@pytest.mark.slow  # about 1 CPU s: two large configs built on the meta device, ten placements planned
def test_the_large_pair_estimate_prints_the_pairs_sizes_and_where_the_teacher_goes():
    out = _run("estimate_large.py")
    gib, billions = _figures(out, "teacher # GiB # B parameters in bf16 (GPU) (from config.json on the meta "
                             "device: no weights here yet); on a CPU it computes in f32, twice that, in RAM")
    assert 29 < billions < 31 and gib == pytest.approx(billions * 1e9 * 2 / 2**30, rel=1e-3)
    sections = out.split("\n--gpus ")[1:]
    assert [s.split()[0] for s in sections] == ["24", "24,24", "80", "141"], out
    sequential = [next(line for line in s.splitlines() if "placement sequential" in line) for s in sections]
    speeds = [float(re.search(r"about ([\d.]+) prompts/s", line).group(1)) for line in sequential]
    # 1 x 24 offloads most of the 56 GiB, 2 x 24 less, 80 and 141 GiB hold it all on one GPU at the seed's 4.5.
    assert "cpu " in sequential[0] and "cuda:1 " in sequential[1] and "cpu " in sequential[1], sequential
    assert speeds[0] < 2.4 < speeds[1] < 4.5 and speeds[2:] == [4.5, 4.5], sequential
    assert all("-> all on one GPU" in line for line in sequential[2:]) and out.count("speed: the seed's") == 1, out


@pytest.mark.slow  # about 20 s: a Run on a copy of the reference project, timed to its first step and stopped
def test_feedback_benchmark_shows_the_first_line_at_once_and_stops_cleanly(finished_project):
    """bench_feedback.py --project (a copy of the suite's finished reference project, instead of the demo project it
    builds and runs first): Run prints its first line, shows a training step (step 1), and a Ctrl-C at that step
    stops it with exit 130, saying so and naming the checkpoint step. How soon is the benchmark's to judge: here its
    two timed rules must follow from the printed seconds (the suite runs it beside other work)."""
    out = _run("bench_feedback.py", "--project", str(finished_project[0]), timed_rules=True)
    assert "first run (shards + training) skipped (--project)" in out, out
    assert "first line" in out and "starting: loading the pipeline" in out, out
    first_step = re.search(r"first step ([\d.]+) s .*\bstep (\d+)/(\d+)", out)
    assert first_step and int(first_step.group(2)) == 1, out
    stop = re.search(r"stop -> stopped ([\d.]+) s, exit 130, said stopped: True, checkpoint step (\d+)", out)
    assert stop and int(stop.group(2)) >= 1, out
    first_line = float(re.search(r"first line ([\d.]+) s \(", out).group(1))
    stop_rule = re.search(r"rule: Stop -> stopped in < (\d+) s, exit 130, says stopped and the step -> (ok|FAIL)", out)
    first_rule = re.search(r"rule: the first line within (\d+) s -> (ok|FAIL)", out)
    assert stop_rule and first_rule and out.count("rule: ") == 2, out
    _follows(stop_rule.group(2), (float(stop.group(1)), "<", float(stop_rule.group(1)), 0.01))
    _follows(first_rule.group(2), (first_line, "<", float(first_rule.group(1)), 0.01))


@pytest.mark.slow  # a few seconds: an LLaDA-Image-shaped text encoder built on the meta device by its own code
def test_the_llada_estimate_sizes_the_text_stack_and_places_its_backbone():
    out = _run("estimate_llada.py", "--quick")
    sections = re.split(r"^--gpus ", out, flags=re.M)[1:]
    assert [s.split()[0] for s in sections] == ["24", "32,6", "80"], out
    assert all("text encoder, QueryFormer and text projection" in s and "by the repo's code" in s for s in sections)
    assert all("teacher placement sequential" in s and "teacher placement balanced" in s for s in sections), out
