"""Training quality: val centred cosine against CPU seconds, the current recipe vs variants.

Four teacher/student families, each built locally by `lib/demo/demo.py: build_demo_materials`
(a random-weight three-layer Qwen3-MoE teacher, 64 wide, with 256 query rows; a Qwen3 student):

    A   the demo's pair: a 48-wide, 2-layer student; the teacher reads a linear lift of the
        student's token embeddings (the student's layer 0, which ggk does not feed the adapter)
    B   the same with a 96-wide student
    C   an independent pair (``independent=True``): a 96-wide, 6-layer student and a teacher whose
        weights are drawn separately (its own token table), with prompts from a scene grammar of
        their own. Nothing ties a student layer to what the teacher reads.
    D   the same pair, then each model trained on its own as a language model on the prompts
        (``pretrain_steps``, 300 steps): two separately *trained* models, whose layers carry what
        the grammar teaches, as real models' do and random ones' cannot.

The corpus, the teacher targets and the student states come from the project's own code
(`build_corpus`, `precompute_split`): the student's final-norm states over ggk's LLaDA-Image template, the
only states ggk feeds the adapter (materials.student_layer: -1, the one value it takes). Every variant is
trained by the real trainer (`train.train_adapter`) on one torch thread, and its CPU time
(`time.process_time`) is measured around that call.

"Current" is the trainer8 recipe at the demo's CPU scale (`demo_settings`: ggk's resampler, 128 wide (two of
ggk's 64-wide heads), 1 block, lr 6e-3, warmup 10 %, cosine to 10 %, AdamW wd 0.01, clip 1.0, whitened MSE
+ 0.5 (1 - cos), batch 16; since #68 the demo's start, presets.CPU_START). ``current-seed1`` and ``-seed2`` are
the same with other seeds (of the adapter's initialization and the data order): the chance spread.

``pre-ggk-adapter`` is the adapter as it was before #55 (benchmarks/pre_ggk_adapter.py: LN_in, a null memory row,
blocks of cross-attention then self-attention then a tanh-GELU MLP, heads of 16 as the old demo's 4 at width 64,
so 8 at 128), trained by the same trainer on the same data with the same recipe (with trainer8's start: it has no
query bank to start at the row means), steps, batch and width, its loss and scores computed by the same code. ggk
cannot load it: it is the pre-#55 baseline, printed to say what the switch to ggk's resampler cost or gained,
never a candidate default.
Variants, each at equal CPU time:

    isotropic              training.target_standardization: isotropic (one std, as PHI-S)
    relational-0.1, -0.3   training.relational_weight (the batch's prompt-to-prompt cosines)
    select-random-N        N of the train prompts chosen at random (the teacher budget is N, not all)
    select-clusters-N      N chosen balanced over k-means clusters of the student's mean states
    select-farthest-N      N chosen by farthest-point sampling of the student's mean states

The two training variants are real settings. The selection
variants train on N = train / 3 prompts picked from the train set (the candidate pool, 3 x N);
their delta is against select-random-N, at the same teacher budget.

Equal CPU time: a short calibration run of each variant measures its CPU seconds per step
(between log events, so fixed costs are left out), and the variant trains
steps = current steps * current s/step / its s/step (the same steps when within 3 %).

The rule (#27): a candidate variant becomes a default when it gains >= 0.01 val centred cosine on the
independent families (C and D, each) and loses no more than the seed-to-seed spread (the larger
|delta| of current-seed1 and -seed2) on A and on B, at most 10 % over the current recipe's CPU seconds.

    .venv/bin/python benchmarks/bench_quality.py                 # all four families (under the 35 CPU minutes it was)
    .venv/bin/python benchmarks/bench_quality.py --pairs C --save c.json   # one family; then
    .venv/bin/python benchmarks/bench_quality.py --merge a.json b.json c.json   # the table and verdict
    .venv/bin/python benchmarks/bench_quality.py --quick         # a smoke run, about a minute
    .venv/bin/python benchmarks/bench_quality.py --pairs CD \
        --variants current-seed1,current-seed2,isotropic   # some rows ("current" always runs)
    .venv/bin/python benchmarks/bench_quality.py --variants current-seed1,current-seed2,pre-ggk-adapter
                                                 # the new adapter against the old one, with the seed spread

The student-layer variants (one other layer, several fused, the product's layer lists) are gone with the
feature: ggk feeds the adapter the student's final norm and nothing else, so no other layer can be adopted.

--study (#68): where the quality goes in ggk's format. On the demo's shards of families A and C (1,600 train / 200
val prompts, 256 query rows; real precompute), every row trains with the same data, steps and schedule (the demo's
recipe, 300 steps; --steps, --training '{"depth": 2, "learning_rate": 1e-3}' for another), once per seed
(--seeds), and prints its val centred cosine, its delta against ``product`` with the same seed, and prompt
retrieval over the non-empty val prompts (top-1, top-5, margin; lib/output/gguf_eval.py: Retrieval, on the torch
model's outputs):

    product                 the product's adapter with trainer8's start (training.init random, query_lr_scale 1)
    minimal-per-dim         a minimal foldable resampler: ggk's, output standardized per dim, loss per dim
    mark-per-row-dim        output standardized per (row, dim): not expressible in ggk's file (the mark)
    init-row-means          training.init: row_means (the untrained adapter outputs each row's mean)
    query-lr-x10, -x30      training.query_lr_scale: the query rows' own learning rate
    cpu-start               both (presets.CPU_START): the demo's and the CPU preset's start since #68
    sigma-floor-0.2         training.sigma_floor 0.2 (0.01 floors nothing on these shards: a line says so)
    isotropic               training.target_standardization: isotropic
    no-empty-prompts        trained without the empty (CFG) prompts (1 % of the train set)
    cosine-weight-0         training.cosine_weight 0 (the loss's cosine term off)
    grad-clip-off, -10      training.grad_clip 0 (off) or 10 (trainer8's is 1.0)
    cpu-start-no-clip       cpu-start with training.grad_clip 0
    weight-decay-0          training.weight_decay 0
    ema-0.999               training.ema_decay 0.999

    .venv/bin/python benchmarks/bench_quality.py --study              # A and C, seeds 0 and 1: about 40 CPU min
    .venv/bin/python benchmarks/bench_quality.py --study --quick --pairs A --seeds 0   # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from pre_ggk_adapter import PreGgkAdapter  # benchmarks/, beside this script
from safetensors.torch import load_file, save_file
from torch import nn

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core import metrics as m
from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.corpus.corpus import build_corpus, read_split
from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint
from gguf_assets.lib.demo.demo import TEACHER_HIDDEN_SIZE, build_demo_materials, demo_settings
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.output.gguf_eval import Retrieval
from gguf_assets.lib.precompute.shards import ShardBuilder, precompute_split
from gguf_assets.lib.precompute.shards_run import data_file, plan_shards
from gguf_assets.lib.project.layout import FINAL_DIR, PROMPTS_FILE, WEIGHTS_FILE, ProjectPaths
from gguf_assets.lib.project.presets import CPU_START
from gguf_assets.lib.project.settings import Settings, replace, write_project_file
from gguf_assets.lib.training import train as train_module
from gguf_assets.lib.training.adapter import Adapter, AdapterShape
from gguf_assets.lib.training.events import LogStep, TrainingEvent
from gguf_assets.lib.training.train import train_adapter
from gguf_assets.lib.training.train_data import load_shard, read_half, shard_batches, shard_size, target_stats
from gguf_assets.lib.training.training_run import shards_identity, training_fingerprint

MARGIN = 0.01          # val centred cosine a variant must gain on each new family (C, D) to be adopted
CPU_TOLERANCE = 1.10   # "equal CPU time": at most this much of the current recipe's CPU seconds
SAME_COST = 0.03       # per-step costs this close count as equal (keeps calibration noise out of the steps)
CLUSTERS = 32          # k of the k-means in select-clusters
NO_EMPTY = "no-empty"  # the selection of every train prompt but the empty (CFG) ones


@dataclass(frozen=True)
class Pair:
    name: str
    student_hidden_size: int
    student_layers: int = 2
    independent: bool = False
    pretrained: bool = False  # both models trained as language models on the prompts (Size.pretrain_steps)


PAIRS = (Pair("A", 48), Pair("B", 96), Pair("C", 96, student_layers=6, independent=True),
         Pair("D", 96, student_layers=6, independent=True, pretrained=True))
NEW_FAMILIES = ("C", "D")  # the rule's: a default must win on each of them


@dataclass(frozen=True)
class Variant:
    name: str
    training: dict = field(default_factory=dict)  # changes to the current recipe's training settings
    select: str | None = None    # train on a third of the train prompts: "random", "clusters", "farthest"
    candidate: bool = True       # False: a reference row that cannot be adopted
    same_cost: bool = False      # the current recipe's steps (its model and data, or a baseline's): no calibration
    build: Callable[..., nn.Module] | None = None  # (shape, *, grad_checkpoint) -> another model class

    def base(self) -> str:
        """The row its delta is read against."""
        return "select-random" if self.select and self.select != "random" else "current"


def pre_ggk_model(shape: AdapterShape, *, grad_checkpoint: bool = False) -> nn.Module:
    """The pre-#55 adapter at the recipe's width, heads of 16 (the old demo's: 4 heads at 64 wide)."""
    return PreGgkAdapter(shape, grad_checkpoint=grad_checkpoint, heads=max(1, shape.width // 16))


PRE_GGK = "pre-ggk-adapter"
# trainer8's start: the pre-#55 adapter's (it has no query bank to start at the row means), and every --study row's
# unless the row changes it.
TRAINER8_START = {"init": "random", "query_lr_scale": 1.0}

VARIANTS = (
    Variant("current", candidate=False, same_cost=True),
    # The same recipe with another seed: how much the cosine moves by chance, to read the deltas against.
    Variant("current-seed1", {"seed": 1}, candidate=False, same_cost=True),
    Variant("current-seed2", {"seed": 2}, candidate=False, same_cost=True),
    # The adapter before #55 (not ggk's; the file ggk loads cannot hold it): the same steps, batch, data and width.
    Variant(PRE_GGK, TRAINER8_START, candidate=False, same_cost=True, build=pre_ggk_model),
    Variant("isotropic", {"target_standardization": "isotropic"}, same_cost=True),
    Variant("relational-0.1", {"relational_weight": 0.1}),
    Variant("relational-0.3", {"relational_weight": 0.3}),
    Variant("select-random", select="random", candidate=False, same_cost=True),
    Variant("select-clusters", select="clusters", same_cost=True),
    Variant("select-farthest", select="farthest", same_cost=True),
)


def variants_for(pair: Pair, only: set[str] | None = None) -> list[Variant]:
    """Every variant, or those named in ``only`` and "current" (every delta's base and the CPU yardstick)."""
    return [v for v in VARIANTS if only is None or v.name in only | {"current"}]


@dataclass(frozen=True)
class Size:
    prompts: int        # prompts the demo builder writes (the corpus dedupes a few)
    train: int
    val: int
    shard_size: int
    query_rows: int
    steps: int          # the current recipe's steps
    calibration_steps: int
    pretrain_steps: int  # family D's language-model training of each model


FULL = Size(prompts=3200, train=2700, val=300, shard_size=900, query_rows=256, steps=600, calibration_steps=60,
            pretrain_steps=300)
QUICK = Size(prompts=100, train=64, val=16, shard_size=64, query_rows=4, steps=4, calibration_steps=4,
             pretrain_steps=4)
# The study's (--study): the demo's shards (1,600 / 200 prompts, 256 query rows), a few hundred steps.
STUDY_SIZE = Size(prompts=1900, train=1600, val=200, shard_size=400, query_rows=256, steps=300, calibration_steps=0,
                  pretrain_steps=300)


# -- materials and shards -----------------------------------------------------------------

@dataclass
class PairData:
    pair: Pair
    settings: Settings
    shards: dict[str, list[Path]]                                             # split -> shard folders
    selected: dict[str, dict[str, list[Path]]] = field(default_factory=dict)  # select -> shards
    prepare_cpu_s: float = 0.0

    def folders(self, variant: Variant) -> dict[str, list[Path]]:
        return self.selected[variant.select] if variant.select else self.shards


SELECTIONS = ("random", "clusters", "farthest")


def prepare_pair(root: Path, pair: Pair, size: Size, *, selections: tuple[str, ...] = SELECTIONS) -> PairData:
    """Materials of this family, the corpus, its shards (real precompute) and the ``selections``."""
    began = time.process_time()
    build_demo_materials(root / "materials" / "demo", seed=0, n_prompts=size.prompts, query_rows=size.query_rows,
                         student_hidden_size=pair.student_hidden_size, student_layers=pair.student_layers,
                         independent=pair.independent,
                         pretrain_steps=size.pretrain_steps if pair.pretrained else 0)
    settings = replace(demo_settings(steps=size.steps),
                       corpus={"train_prompts": size.train, "val_prompts": size.val},
                       precompute={"shard_size": size.shard_size, "val_shard_size": size.val})
    write_project_file(root, settings)
    paths = ProjectPaths.of(root)
    materials = resolve_materials(paths, settings)
    build_corpus(paths, settings, materials, fingerprint=corpus_fingerprint(paths, settings, materials))
    shards = {}
    for split in ("train", "val"):
        keys = [p.key for p in plan_shards(paths, settings, materials, split)]
        precompute_split(paths, settings, materials, split, keys)
        shards[split] = [paths.shard_dir(split, key) for key in keys]
    data = PairData(pair, settings, shards)
    pool = data.shards
    for select in selections:
        rows = select_prompts(pool["train"], size.train // 3, select)
        data.selected[select] = {"train": write_selection(root / f"shards-select-{select}" / "train", pool["train"],
                                                          rows, size.shard_size),
                                 "val": pool["val"]}
    data.prepare_cpu_s = time.process_time() - began
    return data


def write_shard(folder: Path, halves: dict[str, dict[str, torch.Tensor]], metas: dict[str, dict],
                texts: list[str]) -> Path:
    """A shard folder in the on-disk format (prompts, each half's safetensors, its sidecar last)."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_text(folder / PROMPTS_FILE, "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                                     for t in texts))
    for half, tensors in halves.items():
        path = data_file(folder, half)
        with atomic.atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        atomic.write_json(folder / f"{half}.json", {**metas[half], **verify.record(path)})
    return folder


def select_prompts(pool: list[Path], n: int, how: str) -> list[tuple[int, int]]:
    """(shard, row) of ``n`` prompts of the pool, before any teacher would run: from the student's states only.

    The empty prompt keeps its share (the corpus's CFG rows) whatever the method; the other prompts are
    chosen at random, balanced over k-means clusters of their mean student state (round-robin, a random
    member of each cluster in turn), or by farthest-point sampling (each next prompt the one farthest, in
    cosine distance, from all chosen so far). ``no-empty``: every train prompt but the empty ones, whatever ``n``."""
    where, means, empty = [], [], []
    for s, folder in enumerate(pool):
        shard = load_shard(folder)
        for i, text in enumerate(shard.texts):
            (empty if text == "" else where).append((s, i))
            if text:
                means.append(shard.states(i).float().mean(0))
    if how == NO_EMPTY:
        return where
    g = torch.Generator().manual_seed(0)
    n_empty = round(n * len(empty) / (len(empty) + len(where)))
    k = n - n_empty
    points = F.normalize(torch.stack(means), dim=-1)
    if how == "random":
        chosen = torch.randperm(len(where), generator=g)[:k].tolist()
    elif how == "farthest":
        chosen = [int((points @ points.mean(0)).argmax())]  # start nearest the centre: not an outlier
        distance = 1 - points @ points[chosen[0]]
        while len(chosen) < k:
            chosen.append(int(distance.argmax()))
            distance = torch.minimum(distance, 1 - points @ points[chosen[-1]])
    else:
        labels = kmeans(points, min(CLUSTERS, k), g)
        members = [torch.nonzero(labels == c).flatten()[torch.randperm(int((labels == c).sum()), generator=g)].tolist()
                   for c in range(int(labels.max()) + 1)]
        chosen = []
        while len(chosen) < k:
            for group in members:
                if group and len(chosen) < k:
                    chosen.append(group.pop())
    return sorted(empty[:n_empty] + [where[i] for i in chosen])


def kmeans(points: torch.Tensor, k: int, g: torch.Generator, iterations: int = 25) -> torch.Tensor:
    """Cluster labels of unit vectors (spherical k-means, seeded k-means++ start)."""
    centres = [points[int(torch.randint(len(points), (1,), generator=g))]]
    for _ in range(1, k):
        nearest = (1 - points @ torch.stack(centres).T).min(1).values.clamp_min(0)
        centres.append(points[int(torch.multinomial(nearest + 1e-12, 1, generator=g))])
    centres = torch.stack(centres)
    for _ in range(iterations):
        labels = (points @ centres.T).argmax(1)
        for c in range(k):
            if (labels == c).any():
                centres[c] = F.normalize(points[labels == c].mean(0), dim=-1)
    return (points @ centres.T).argmax(1)


def write_selection(folder: Path, pool: list[Path], rows: list[tuple[int, int]], per_shard: int) -> list[Path]:
    """The chosen prompts as shards of their own (teacher targets and student states copied, in pool order)."""
    loaded = {s: (load_shard(pool[s]), read_half(pool[s], "student")["token_ids"]) for s in {s for s, _ in rows}}
    out = []
    for start in range(0, len(rows), per_shard):
        chunk = rows[start:start + per_shard]
        states = [loaded[s][0].states(i) for s, i in chunk]
        tokens = [loaded[s][1][loaded[s][0].offsets[i]:loaded[s][0].offsets[i + 1]] for s, i in chunk]
        lengths = torch.tensor([len(x) for x in states], dtype=torch.int64)
        student = {"hidden": torch.cat(states), "offsets": torch.cat([torch.zeros(1, dtype=torch.int64),
                                                                      lengths.cumsum(0)]),
                   "token_ids": torch.cat(tokens)}
        teacher = {"targets": torch.stack([loaded[s][0].targets[i] for s, i in chunk])}
        metas = {half: {**atomic.read_json(pool[chunk[0][0]] / f"{half}.json"), "prompts": len(chunk),
                        "fingerprint": atomic.fingerprint([half, [(pool[s].name, i) for s, i in chunk]])}
                 for half in ("teacher", "student")}
        out.append(write_shard(folder / f"{len(out):05d}", {"teacher": teacher, "student": student}, metas,
                               [loaded[s][0].texts[i] for s, i in chunk]))
    return out


def teacher_order(root: Path, data: PairData, n: int = 100) -> tuple[float, float]:
    """How much the teacher's targets depend on word order, which the adapter sees only through the student's
    states (it adds no positions of its own): the centred cosine between a val prompt's targets and those of
    its words shuffled, and between two different val prompts (the floor)."""
    paths = ProjectPaths.of(root)
    texts = [t for t in read_split(paths, "val") if len(t.split()) >= 4][:n]
    rng, shuffled = random.Random(0), []
    for text in texts:
        words = text.split()
        while " ".join(words) == text:
            rng.shuffle(words)
        shuffled.append(" ".join(words))
    builder = ShardBuilder(paths, data.settings, resolve_materials(paths, data.settings))
    original, reordered = (builder.targets(batch).targets.float() for batch in (texts, shuffled))
    mean = target_stats(data.shards["train"], sigma_floor=1e-6).centre

    def centred_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(F.cosine_similarity(a - mean, b - mean, dim=-1).mean())

    return centred_cosine(original, reordered), centred_cosine(original, original.roll(1, 0))


# -- training -----------------------------------------------------------------------------

@contextlib.contextmanager
def variant_model(variant: Variant):
    """The trainer builds the variant's model class (seeded as its own build_model seeds) while this is active."""
    if variant.build is None:
        yield
        return
    original = train_module.build_model

    def build(shape: AdapterShape, *, seed: int, grad_checkpoint: bool = False) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return variant.build(shape, grad_checkpoint=grad_checkpoint)

    train_module.build_model = build
    try:
        yield
    finally:
        train_module.build_model = original


def train_once(work: Path, data: PairData, variant: Variant, steps: int, *, log_every: int,
               retrieval: bool = False) -> dict:
    """One real training run; returns its summary, CPU seconds and CPU seconds per step between logs, and with
    ``retrieval`` the final weights' prompt retrieval on the val shards (``val_retrieval``)."""
    warmup = variant.training.get("warmup_steps", max(1, steps // 10))
    training = {**variant.training, "steps": steps, "warmup_steps": min(warmup, steps), "log_every": log_every,
                "validate_every": steps, "checkpoint_every": steps, "keep_checkpoints": 1, "device": "cpu"}
    settings = replace(data.settings, training=training)
    folders = data.folders(variant)
    fingerprint = training_fingerprint(settings, [shards_identity(folders["train"])], [shards_identity(folders["val"])])
    marks: list[tuple[int, float]] = []

    def on_event(event: TrainingEvent) -> None:
        if isinstance(event, LogStep):
            marks.append((event.step, time.process_time()))

    run_root = work / f"run-{time.monotonic_ns()}"
    began = time.process_time()
    with variant_model(variant):
        summary = train_adapter(ProjectPaths.of(run_root), settings, train_folders=folders["train"],
                                val_folders=folders["val"], fingerprint=fingerprint, on_event=on_event)
    cpu = time.process_time() - began
    found = (val_retrieval(ProjectPaths.of(run_root).checkpoints_dir(fingerprint) / FINAL_DIR / WEIGHTS_FILE,
                           variant, folders["val"]) if retrieval else {})
    shutil.rmtree(run_root, ignore_errors=True)
    # The fastest log window after the first (warm-up) one: a neighbour's burst on a shared machine
    # only ever adds CPU time (caches, memory bandwidth), so the minimum is the steadiest estimate.
    windows = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(marks, marks[1:])]
    return {"summary": summary, "cpu_s": cpu, "cpu_per_step": min(windows, default=cpu / steps), **found}


@torch.inference_mode()
def val_retrieval(weights: Path, variant: Variant, val_folders: list[Path]) -> dict:
    """Prompt retrieval of the trained weights (the variant's model class) over the non-empty val prompts, as the
    GGUF's evaluation computes it (lib/output/gguf_eval.py: Retrieval), from the torch model's outputs."""
    state = load_file(str(weights))
    rows, dim = state["target_centre"].shape
    shape = AdapterShape(student_dim=state["in_proj.weight"].shape[1], query_rows=rows, target_dim=dim,
                         width=state["query"].shape[1], depth=len({k.split(".")[1] for k in state if
                                                                  k.startswith("blocks.")}))
    model = (variant.build or Adapter)(shape, grad_checkpoint=False)
    model.load_state_dict(state)
    model.eval()
    texts = [t for folder in val_folders for t in load_shard(folder).texts]
    retrieval = Retrieval(model.target_centre.numpy(), prompts=sum(1 for t in texts if t))
    for folder in val_folders:
        for shard, batch_rows, states, mask, targets in shard_batches(folder, device=torch.device("cpu")):
            pred = model.to_target_space(model(states, mask).float())
            for j, i in enumerate(batch_rows):
                if shard.texts[i]:  # the empty prompts are one prompt, the CFG's: not retrieved
                    retrieval.add(pred[j].numpy(), targets[j].numpy())
    return {"val_retrieval": retrieval.result()}


def step_costs(work: Path, data: PairData, variants: list[Variant], size: Size) -> dict[str, float]:
    """CPU seconds per training step of each variant, from short runs (fixed costs left out)."""
    costs = {}
    # The first run of a process is slower (allocator, caches); run once untimed so that "current",
    # calibrated first, is not charged for it and every other variant handed extra steps.
    for variant in (variants[0], *variants):
        if variant.same_cost and variant.name != "current":
            continue
        run = train_once(work, data, variant, size.calibration_steps, log_every=max(1, size.calibration_steps // 4))
        costs[variant.name] = run["cpu_per_step"]
    return {v.name: costs["current"] if v.same_cost else costs[v.name] for v in variants}


def equal_cpu_steps(base_steps: int, base_cost: float, cost: float) -> int:
    if abs(cost / base_cost - 1) <= SAME_COST:
        return base_steps
    return max(1, round(base_steps * base_cost / cost))


PAIR_KINDS = {(False, False): "the teacher reads a lift of its layer 0", (True, False): "independent of the teacher",
              (True, True): "independent of the teacher, both trained as language models"}


def measure_pair(root: Path, pair: Pair, size: Size, *, train: bool = True, only: set[str] | None = None) -> list[dict]:
    data = prepare_pair(root / f"pair-{pair.name}", pair, size)
    train_folders = data.shards["train"]
    dims = atomic.read_json(train_folders[0] / "student.json")["dim"]
    print(f"pair {pair.name}: student {dims} wide, {pair.student_layers} layers "
          f"({PAIR_KINDS[(pair.independent, pair.pretrained)]}), "
          f"read at its final norm; teacher {TEACHER_HIDDEN_SIZE} wide x {size.query_rows} "
          f"query rows; {sum(shard_size(f) for f in train_folders)} train / "
          f"{sum(shard_size(f) for f in data.shards['val'])} val prompts, selections of "
          f"{sum(shard_size(f) for f in data.selected['random']['train'])}; materials + corpus + shards "
          f"{data.prepare_cpu_s:.0f} CPU s", file=sys.stderr, flush=True)
    shuffled, different = teacher_order(root / f"pair-{pair.name}", data)
    print(f"  teacher order, pair {pair.name}: a val prompt's targets vs its words shuffled, centred cosine "
          f"{shuffled:.4f} (two different prompts: {different:.4f})", flush=True)
    if not train:
        return []
    variants = variants_for(pair, only)
    costs = step_costs(root / "runs", data, variants, size)
    rows = []
    for variant in variants:
        steps = equal_cpu_steps(size.steps, costs["current"], costs[variant.name])
        run = train_once(root / "runs", data, variant, steps, log_every=max(1, steps // 10))
        rows.append({"pair": pair.name, "variant": variant.name, "steps": steps, "cpu_s": run["cpu_s"],
                     "cosine": run["summary"].val_centred_cosine})
        print(f"  {variant.name}: {steps} steps, {run['cpu_s']:.1f} CPU s, val centred cosine "
              f"{rows[-1]['cosine']:.4f}", file=sys.stderr, flush=True)
    return rows


# -- the table and the rule ---------------------------------------------------------------

def report(rows: list[dict]) -> None:
    """Prints the table (deltas against each row's base, CPU ratios against current) and the verdict."""
    by = {(r["pair"], r["variant"]): r for r in rows}
    variants = {v.name: v for v in VARIANTS}
    print(f"{'pair':<4} {'variant':<18} {'steps':>6} {'CPU s':>7} {'CPU ratio':>9} {'val cos':>8} {'delta':>8}  vs")
    for r in rows:
        base = variants[r["variant"]].base()
        r["delta"] = r["cosine"] - by[(r["pair"], base)]["cosine"]
        r["cpu_ratio"] = r["cpu_s"] / by[(r["pair"], "current")]["cpu_s"]
        print(f"{r['pair']:<4} {r['variant']:<18} {r['steps']:>6} {r['cpu_s']:>7.2f} {r['cpu_ratio']:>9.2f} "
              f"{r['cosine']:>8.4f} {r['delta']:>+8.4f}  {base}")
    pairs = sorted({r["pair"] for r in rows})
    seeds = {p: [abs(by[(p, f"current-seed{k}")]["delta"]) for k in (1, 2) if (p, f"current-seed{k}") in by]
             for p in pairs}
    spread = {p: max(seeds[p], default=float("nan")) for p in pairs}  # unknown when --variants left the seeds out
    print("seed-to-seed spread: " + ", ".join(f"{p} {spread[p]:.4f}" for p in pairs))
    for p in pairs:
        if (p, PRE_GGK) in by:
            old, new = by[(p, PRE_GGK)], by[(p, "current")]
            print(f"pre-ggk baseline, pair {p}: val centred cosine current {new['cosine']:.4f}, {PRE_GGK} "
                  f"{old['cosine']:.4f}, current - pre-ggk {new['cosine'] - old['cosine']:+.4f} (seed spread "
                  f"{spread[p]:.4f}); CPU s current {new['cpu_s']:.2f}, {PRE_GGK} {old['cpu_s']:.2f} at "
                  f"{old['steps']} steps each")
    if not {"A", "B", *NEW_FAMILIES} <= set(pairs):
        print(f"the verdict needs families A, B, {', '.join(NEW_FAMILIES)} (--merge the saved rows)")
        return
    winners = []
    for name, variant in variants.items():
        if not variant.candidate or any((p, name) not in by for p in NEW_FAMILIES):
            continue  # a reference row (the seeds, select-random, the pre-#55 adapter), or one --variants left out
        new = [by[(p, name)] for p in NEW_FAMILIES]
        others = [by[(p, name)] for p in ("A", "B") if (p, name) in by]
        if (all(r["delta"] >= MARGIN for r in new) and all(r["delta"] >= -spread[r["pair"]] for r in others)
                and all(r["cpu_ratio"] <= CPU_TOLERANCE for r in [*new, *others])):
            winners.append((min(r["delta"] for r in new), name))
    for gain, name in sorted(winners, reverse=True):
        print(f"winner: {name} (+{gain:.4f} or more on {' and '.join(NEW_FAMILIES)} against "
              f"{variants[name].base()}, within the seed spread or better on A and B, at equal CPU time)")
    if not winners:
        print(f"no variant gains >= {MARGIN} on {' and '.join(NEW_FAMILIES)} without losing beyond the seed spread "
              "on A or B; defaults unchanged")


# -- the ggk-format study (#68) -----------------------------------------------------------------------------------

class MinimalResampler(Adapter):
    """ggk's resampler with its output standardized per dim (foldable into out_proj, as the product's) and the loss
    per dim too: whitened MSE + cos, both on (target - mean[D]) / std[D]. The plain baseline #68 measured."""

    def loss_space(self, standardized: torch.Tensor) -> torch.Tensor:
        return standardized

    def loss_targets(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets.float() - self.target_mean) / self.target_std


class PerRowDimMark(Adapter):
    """ggk's resampler with its output standardized per (row, dim): y = (target - centre[Q, D]) / std[Q, D], so
    each query row's mean comes free. Not expressible in ggk's file (no tensor holds a per-row offset or scale:
    only a map shared by the rows folds into out_proj); printed as the mark to reach."""

    def to_target_space(self, standardized: torch.Tensor) -> torch.Tensor:
        return standardized * self.loss_std + self.target_centre

    def loss_space(self, standardized: torch.Tensor) -> torch.Tensor:
        return standardized

    def loss_targets(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets.float() - self.target_centre) / self.loss_std


PRODUCT, MINIMAL, MARK, CPU = "product", "minimal-per-dim", "mark-per-row-dim", "cpu-start"
STUDY = (
    Variant(PRODUCT, candidate=False, same_cost=True),
    Variant(MINIMAL, candidate=False, same_cost=True, build=MinimalResampler),
    Variant(MARK, candidate=False, same_cost=True, build=PerRowDimMark),
    # One change at a time to the product, each a setting: the file stays what ggk computes.
    Variant("init-row-means", {"init": "row_means"}, same_cost=True),
    Variant("query-lr-x10", {"query_lr_scale": 10.0}, same_cost=True),
    Variant("query-lr-x30", {"query_lr_scale": 30.0}, same_cost=True),
    Variant(CPU, CPU_START, same_cost=True),  # both: the demo's and the CPU preset's start since #68
    Variant("sigma-floor-0.2", {"sigma_floor": 0.2}, same_cost=True),
    Variant("isotropic", {"target_standardization": "isotropic"}, same_cost=True),
    Variant("no-empty-prompts", select=NO_EMPTY, same_cost=True),
    # The training loop's own terms, each off in turn (#68's small gap: a plain resampler with the product's loss
    # scored 0.013 above it on the hidden task).
    Variant("cosine-weight-0", {"cosine_weight": 0.0}, same_cost=True),
    Variant("grad-clip-off", {"grad_clip": 0.0}, same_cost=True),
    Variant("grad-clip-10", {"grad_clip": 10.0}, same_cost=True),
    Variant("cpu-start-no-clip", {**CPU_START, "grad_clip": 0.0}, same_cost=True),
    Variant("weight-decay-0", {"weight_decay": 0.0}, same_cost=True),
    Variant("ema-0.999", {"ema_decay": 0.999}, same_cost=True),
)


def target_shape_line(data: PairData) -> str:
    """How much of the targets the query rows' means carry, and what the sigma floor and the empty prompts touch."""
    stats = target_stats(data.shards["train"], sigma_floor=1e-12)
    rows_part = float((stats.centre - stats.centre.mean(0)).square().mean())
    prompt_part = float(stats.loss_std.square().mean())
    floor = data.settings.training.sigma_floor
    texts = [t for folder in data.shards["train"] for t in load_shard(folder).texts]
    share = rows_part / (rows_part + prompt_part)
    return (f"  targets, pair {data.pair.name}: the query rows' means carry {share:.1%} of the variance; "
            f"per-(row, dim) std from {float(stats.loss_std.min()):.3g} (sigma_floor {floor:g} floors "
            f"{int((stats.loss_std < floor).sum())} of {stats.loss_std.numel():,}); {texts.count('')} empty of "
            f"{len(texts):,} train prompts")


def measure_study(root: Path, pair: Pair, size: Size, *, seeds: list[int], training: dict,
                  only: set[str] | None = None) -> list[dict]:
    """Every study row on this family's shards, with each seed, at the same steps; prints each as it ends.
    ``training``: changes to the demo's recipe for every row."""
    data = prepare_pair(root / f"pair-{pair.name}", pair, size, selections=(NO_EMPTY,))
    data.settings = replace(data.settings, training={**TRAINER8_START, **training})
    print(target_shape_line(data), flush=True)
    rows = []
    for seed in seeds:
        for variant in (v for v in STUDY if only is None or v.name in only | {PRODUCT}):
            variant = Variant(variant.name, {**variant.training, "seed": seed}, variant.select, variant.candidate,
                              variant.same_cost, variant.build)
            run = train_once(root / "runs", data, variant, size.steps, log_every=max(1, size.steps // 10),
                             retrieval=True)
            found = run["val_retrieval"]
            rows.append({"pair": pair.name, "variant": variant.name, "seed": seed, "steps": size.steps,
                         "cpu_s": run["cpu_s"], "cosine": run["summary"].val_centred_cosine,
                         "top1": found[m.VAL_RETRIEVAL_TOP1], "top5": found[m.VAL_RETRIEVAL_TOP5],
                         "margin": found[m.VAL_RETRIEVAL_MARGIN], "prompts": found[m.VAL_RETRIEVAL_PROMPTS]})
            print(f"  {pair.name} {variant.name} seed {seed}: val centred cosine {rows[-1]['cosine']:.4f}, "
                  f"{run['cpu_s']:.1f} CPU s", file=sys.stderr, flush=True)
    return rows


def study_report(rows: list[dict]) -> None:
    """The study's table: per family and seed, each row's val centred cosine, its delta against the product with
    the same seed, and prompt retrieval; then each change's mean delta over the seeds and the product's place
    between the minimal resampler and the mark."""
    by = {(r["pair"], r["variant"], r["seed"]): r for r in rows}
    print(f"{'pair':<4} {'variant':<24} {'seed':>4} {'steps':>5} {'val cos':>7} {'delta':>7} {'top-1':>5} "
          f"{'top-5':>5} {'margin':>6}")
    for r in rows:
        r["delta"] = r["cosine"] - by[(r["pair"], PRODUCT, r["seed"])]["cosine"]
        print(f"{r['pair']:<4} {r['variant']:<24} {r['seed']:>4} {r['steps']:>5} {r['cosine']:>7.4f} "
              f"{r['delta']:>+7.4f} {r['top1']:>5.3f} {r['top5']:>5.3f} {r['margin']:>6.4f}")
    for pair in sorted({r["pair"] for r in rows}):
        mine = [r for r in rows if r["pair"] == pair]
        seeds = sorted({r["seed"] for r in mine})
        spread = max((abs(by[(pair, PRODUCT, s)]["cosine"] - by[(pair, PRODUCT, seeds[0])]["cosine"])
                      for s in seeds), default=0.0)
        print(f"pair {pair}, seeds {', '.join(map(str, seeds))}: the product's seed-to-seed spread {spread:.4f}")
        for name in dict.fromkeys(r["variant"] for r in mine):
            if name == PRODUCT:
                continue
            deltas = [r["delta"] for r in mine if r["variant"] == name]
            print(f"  {name}: mean delta {sum(deltas) / len(deltas):+.4f} (min {min(deltas):+.4f}, max "
                  f"{max(deltas):+.4f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, about a minute")
    parser.add_argument("--steps", type=int, help="the current recipe's steps (default: 600, --quick 4)")
    parser.add_argument("--pairs", help="the families to measure (default ABCD; --study: AC)")
    parser.add_argument("--study", action="store_true",
                        help="the ggk-format study (#68): the product, the minimal resampler, the per-(row, dim) "
                             "mark and one change at a time, with prompt retrieval, at the same steps")
    parser.add_argument("--seeds", default="0,1", help="--study: the seeds each row trains with (default 0,1)")
    parser.add_argument("--training", default="{}",
                        help='--study: changes to the demo recipe for every row, as JSON (e.g. \'{"depth": 2}\')')
    parser.add_argument("--variants", help="only these variants, comma-separated (and current, the base)")
    parser.add_argument("--save", type=Path, help="also write the measured rows here (json)")
    parser.add_argument("--merge", type=Path, nargs="+", help="print the table and verdict of saved rows")
    parser.add_argument("--order-only", action="store_true",
                        help="build the families and measure only how much their teachers depend on word order")
    parser.add_argument("--keep", type=Path, help="build everything here and keep it")
    args = parser.parse_args(argv)
    if args.merge:
        saved = [row for path in args.merge for row in json.loads(path.read_text())]
        (study_report if saved and "seed" in saved[0] else report)(saved)
        return 0
    torch.set_num_threads(1)  # CPU seconds comparable between runs and machines, whatever the neighbours do
    quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    size = QUICK if args.quick else STUDY_SIZE if args.study else FULL
    pairs = args.pairs or ("AC" if args.study else "ABCD")
    if args.steps:
        size = Size(**{**size.__dict__, "steps": args.steps})
    began = time.process_time()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-quality-"))
    rows: list[dict] = []
    try:
        only = set(args.variants.split(",")) if args.variants else None
        for pair in (p for p in PAIRS if p.name in pairs):
            if args.study:
                rows += measure_study(root, pair, size, seeds=[int(x) for x in args.seeds.split(",")],
                                      training=json.loads(args.training), only=only)
            else:
                rows += measure_pair(root, pair, size, train=not args.order_only, only=only)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.order_only:
        return 0
    if args.save:
        atomic.write_json(args.save, rows)
    (study_report if args.study else report)(rows)
    print(f"benchmark CPU time: {time.process_time() - began:.0f} s (torch threads {torch.get_num_threads()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
