"""Offline, seeded builder for the tiny materials of the demo project.

``build_demo_materials(root)`` writes four folders under ``root``:

* ``teacher/`` -- a random-weight ``Qwen3MoeForCausalLM`` (safetensors), the shared
  tokenizer, and ``query_rows.safetensors``: the learned query rows that the pipeline
  appends after the prompt embeddings before reading the teacher's last hidden states.
* ``student/`` -- a random-weight ``Qwen3ForCausalLM`` with a different hidden size and
  the same tokenizer.
* ``sigvq/`` -- a tiny random SigVQ vision encoder (``build_demo_sigvq``), exported as the GGUF ggk's
  ``--llm_vision`` loads.
* ``dataset/`` -- ``prompts.jsonl`` (``{"text": ...}`` per line, with a few deliberate
  exact duplicates) and a ``README.md`` dataset card.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the generated
prompts. The same seed gives byte-identical files, and the caller's global torch RNG
state is left untouched. Everything is sized to build in a few seconds on a laptop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from gguf_assets.lib.core.ggk_contract import (
    LLADA_IMAGE,
    STUDENT_HEAD_DIM,
    STUDENT_RMS_NORM_EPS,
    STUDENT_ROPE_THETA,
)
from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.demo import DEMO_STEPS
from gguf_assets.lib.materials.ggk_tokenizer import byte_symbols, qwen2_pre_tokenizer, tokenizer_from_merges
from gguf_assets.lib.project.presets import CPU_START
from gguf_assets.lib.project.settings import Corpus, Materials, Output, Precompute, Settings, Training

if TYPE_CHECKING:
    from transformers import (
        PreTrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerFast,
        Qwen3ForCausalLM,
        Qwen3MoeForCausalLM,
    )

_Model = TypeVar("_Model", bound="PreTrainedModel")

logger = logging.getLogger(__name__)

__all__ = [
    "DemoMaterials",
    "QUARTER_SIZES",
    "build_demo_materials",
    "EOS_TOKEN",
    "QUERY_ROWS_FILENAME",
    "QUERY_ROWS_TENSOR",
    "PROMPTS_FILENAME",
    "TEACHER_HIDDEN_SIZE",
    "STUDENT_HIDDEN_SIZE",
    "STUDENT_LAYERS",
    "TEACHER_LAYERS",
    "INITIALIZER_RANGE",
    "QUERY_ROW_SCALE",
    "iter_prompts",
    "build_demo_sigvq",
]

EOS_TOKEN = "<|endoftext|>"
QUERY_ROWS_FILENAME = "query_rows.safetensors"
QUERY_ROWS_TENSOR = "query_rows"
PROMPTS_FILENAME = "prompts.jsonl"

TOKENIZER_VOCAB_SIZE = 1000
MAX_POSITION_EMBEDDINGS = 2048
TEACHER_HIDDEN_SIZE = 64
STUDENT_HIDDEN_SIZE = 48
STUDENT_LAYERS = 2
# Three layers, chosen by measurement (demo, 1500 steps, seed 0): 1 layer 0.78 val centred
# cosine, 2 0.87, 3 0.92, 4 0.90, 6 0.91, 8 0.89; seeds 1 and 2 at three layers: 0.916, 0.903.
# Our reading, not proven: each layer lets the query rows average over more of the prompt,
# which smooths the outputs, and past three the random MoE blocks add more nonlinearity.
TEACHER_LAYERS = 3
# Small on purpose. The demo is sized so that a small student + adapter can learn the
# teacher in a few CPU minutes: with q/k-norm attention the logits are O(1) whatever the
# scale, but each layer's update relative to its residual grows with initializer_range x
# hidden_size. At 0.1 the teacher is strongly nonlinear (a 128-wide adapter plateaus near
# 0.4-0.6 val centred cosine); at 0.03 it stays close to "attention-weighted sums of token
# embeddings", which the adapter's cross-attention mirrors, and ~20% of the query-row
# outputs' mean square still varies across prompts.
INITIALIZER_RANGE = 0.03
# Query rows a bit smaller than the token embeddings (ratio 2/3), so the prompt moves them
# more than it moves its own tokens: outputs depend on the prompt, while the prompt
# tokens stay close to their embeddings (little token-token mixing for the student to copy).
QUERY_ROW_SCALE = 0.02
# The demo pair's student writes a tenth of its init to the residual stream, so that its final-norm states (what
# ggk feeds the adapter) stay close to its token embeddings, of which the teacher's are a lift, while its layers still
# compute (attention, rope, MLP: what the ggk tests check). Measured (1000 steps, 128 wide): at full scale the
# adapter learns this teacher to about 0.76 val centred cosine; at 0.1 and 0 to 0.84-0.85 (64 wide).
STUDENT_RESIDUAL_SCALE = 0.1
# The independent pair's student (build_demo_materials(independent=True)).
INDEPENDENT_STUDENT_INIT = 2 * INITIALIZER_RANGE

# Share of the prompts that are exact copies of earlier ones (the corpus step dedupes).
_DUPLICATE_FRACTION = 0.005


@dataclass(frozen=True)
class DemoMaterials:
    """Where ``build_demo_materials`` put the demo folders."""

    teacher_dir: Path
    student_dir: Path
    dataset_dir: Path
    sigvq_dir: Path


# --------------------------------------------------------------------------- prompts

_ADJECTIVES = (
    "red", "blue", "golden", "silver", "ancient", "tiny", "giant", "lonely", "quiet",
    "misty", "glowing", "rusty", "wooden", "crystal", "frozen", "burning", "gentle",
    "fierce", "sleepy", "curious", "majestic", "broken", "floating", "hidden", "neon",
    "velvet", "stormy", "sunlit", "moonlit", "overgrown", "mechanical", "paper",
    "marble", "emerald", "crimson", "pastel", "shadowy", "cheerful", "weathered",
    "ornate",
)
_SUBJECTS = (
    "fox", "cat", "owl", "dragon", "robot", "lighthouse", "castle", "forest", "river",
    "mountain", "city", "garden", "ship", "whale", "astronaut", "wizard", "knight",
    "tree", "bridge", "train", "village", "deer", "butterfly", "tiger", "teapot",
    "library", "cathedral", "desert", "island", "waterfall", "horse", "samurai",
    "bicycle", "lantern", "violin", "mushroom", "octopus", "balloon", "greenhouse",
    "windmill", "girl", "old man", "musician", "dancer", "farmer", "painter",
)
_ACTIONS = (
    "standing", "sleeping", "flying", "resting", "walking", "dancing", "reading a book",
    "looking at the stars", "drifting", "waiting", "playing music", "hiding",
    "watching the sunset", "crossing a bridge", "sitting quietly", "running",
    "climbing", "glowing softly", "floating", "exploring",
)
_SETTINGS = (
    "in a misty forest", "on a quiet beach", "under a starry sky", "in a busy market",
    "at the edge of a cliff", "in a snowy valley", "inside an old library",
    "on a rainy street", "in a field of flowers", "beside a calm lake",
    "in a futuristic city", "on the surface of the moon", "in a desert at dawn",
    "deep under the sea", "among the clouds", "in a cozy kitchen", "on a mountain top",
    "in a ruined temple", "at a train station", "in a candlelit room",
)
_STYLES = (
    "oil painting", "watercolor", "digital art", "concept art", "photograph",
    "pencil sketch", "ink drawing", "3d render", "pixel art", "studio photo",
    "illustration", "matte painting", "charcoal drawing", "anime style",
    "storybook illustration", "low poly", "isometric view", "vintage poster",
)
_LIGHTING = (
    "soft light", "golden hour", "dramatic lighting", "volumetric fog",
    "warm sunlight", "cold blue light", "rim lighting", "candlelight", "moonlight",
    "overcast sky", "neon glow", "backlit", "long shadows", "diffuse light",
)
_DETAILS = (
    "highly detailed", "sharp focus", "intricate patterns", "rich colors",
    "muted palette", "shallow depth of field", "wide angle", "close up",
    "cinematic composition", "soft focus background", "fine textures",
    "gentle gradients", "strong contrast", "symmetrical", "film grain",
    "bokeh", "4k", "trending", "award winning", "clean lines",
)
_CLAUSES = (
    "the air is full of drifting leaves",
    "a small bird watches from a branch nearby",
    "light spills through tall windows",
    "the ground is covered in fresh snow",
    "old stone walls are wrapped in ivy",
    "a narrow path winds toward the horizon",
    "reflections shimmer on the wet pavement",
    "colorful lanterns hang overhead",
    "distant hills fade into blue haze",
    "tiny fireflies float in the dark",
    "waves crash against jagged rocks",
    "clouds gather above the rooftops",
    "a warm glow comes from a single window",
    "petals swirl in the gentle wind",
    "steam rises from a cup of tea",
    "the scene feels calm and timeless",
    "everything is painted in soft pastel tones",
    "the sky burns orange and purple",
)


def _article(phrase: str) -> str:
    return "an" if phrase[0] in "aeiou" else "a"


def _noun_phrase(rng: random.Random) -> str:
    phrase = f"{rng.choice(_ADJECTIVES)} {rng.choice(_SUBJECTS)}"
    return f"{_article(phrase)} {phrase}"


def _short_prompt(rng: random.Random) -> str:
    # 1..5 words: the terse prompts people actually type.
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice(_SUBJECTS)
    if kind == 1:
        return f"{rng.choice(_ADJECTIVES)} {rng.choice(_SUBJECTS)}"
    if kind == 2:
        return _noun_phrase(rng)
    if kind == 3:
        return f"{rng.choice(_SUBJECTS)}, {rng.choice(_STYLES)}"
    return f"{_noun_phrase(rng)} {rng.choice(_ACTIONS).split()[0]}"


def _medium_prompt(rng: random.Random) -> str:
    parts = [f"{_noun_phrase(rng)} {rng.choice(_ACTIONS)} {rng.choice(_SETTINGS)}"]
    parts += rng.sample(_STYLES, 1) + rng.sample(_LIGHTING, rng.randint(0, 1))
    parts += rng.sample(_DETAILS, rng.randint(0, 3))
    return ", ".join(parts)


def _long_prompt(rng: random.Random) -> str:
    target = rng.randint(31, 60)
    first = f"{_noun_phrase(rng)} {rng.choice(_ACTIONS)} {rng.choice(_SETTINGS)}"
    sentences = [first[0].upper() + first[1:]]
    sentences += [c[0].upper() + c[1:] for c in rng.sample(_CLAUSES, rng.randint(2, 4))]
    words = ". ".join(sentences).split() + ["."]
    tags = rng.sample(_STYLES, 2) + rng.sample(_LIGHTING, 2) + rng.sample(_DETAILS, 8)
    for tag in tags:
        if len(words) >= target:
            break
        words += tag.split()
        words[-1] += ","
    text = " ".join(words[:60]).rstrip(",").replace(" .", ".")
    return text


def _demo_prompt(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.35:
        return _short_prompt(rng)
    if roll < 0.8:
        return _medium_prompt(rng)
    return _long_prompt(rng)


# The independent pair's prompts (benchmarks/bench_quality.py, family C): a grammar and vocabulary of their
# own, so nothing in it was tuned on the demo's prompts. Scenes of counted objects with attributes and
# spatial relations, where word order matters (what is left of what), unlike a bag of style tags.
_COUNTS = ("one", "two", "three", "four", "five", "six", "a dozen", "many", "a pair of", "several")
_COLORS = ("scarlet", "teal", "ochre", "violet", "charcoal", "ivory", "amber", "cobalt", "olive", "coral",
           "magenta", "bronze")
_OBJECTS = ("cube", "sphere", "cone", "pyramid", "cylinder", "torus", "chair", "lamp", "bottle", "kettle",
            "umbrella", "clock", "shoe", "book", "candle", "vase", "apple", "feather")
_MATERIALS = ("glass", "felt", "chrome", "clay", "paper", "jade", "rubber", "oak", "wool", "ice")
_RELATIONS = ("left of", "right of", "on top of", "underneath", "behind", "in front of", "inside", "next to",
              "leaning on", "orbiting")
_PLACES = ("on a checkered floor", "on a white table", "in an empty room", "on a sand dune", "on a rooftop",
           "in a shallow pool", "on a shelf", "in a glass box", "on a tiled kitchen counter")
_CAMERAS = ("top-down view", "eye level", "macro shot", "wide shot", "tilted frame", "orthographic",
            "35mm lens", "fisheye lens", "long exposure")


def _scene_object(rng: random.Random) -> str:
    words = [rng.choice(_COUNTS), rng.choice(_COLORS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_MATERIALS))
    noun = rng.choice(_OBJECTS)
    return " ".join(words + [noun if words[0] == "one" else noun + "s"])


def _scene_prompt(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.3:  # a terse object or two
        return _scene_object(rng) if rng.random() < 0.5 else f"{_scene_object(rng)} and {_scene_object(rng)}"
    parts = [f"{_scene_object(rng)} {rng.choice(_RELATIONS)} {_scene_object(rng)}"]
    for _ in range(rng.randint(0, 3) if roll < 0.8 else rng.randint(3, 6)):
        parts.append(f"{rng.choice(_RELATIONS)} {_scene_object(rng)}")
    parts.append(rng.choice(_PLACES))
    parts += rng.sample(_CAMERAS, rng.randint(0, 2))
    return ", ".join(parts)


def _with_duplicates(rng: random.Random, n_prompts: int, generate) -> list[str]:
    """``n_prompts`` prompts from ``generate(rng)``: unique ones of mixed length, then a few exact duplicates
    spliced in after their originals (the corpus step dedupes them)."""
    n_dupes = max(1, round(n_prompts * _DUPLICATE_FRACTION)) if n_prompts >= 2 else 0
    n_unique = n_prompts - n_dupes
    seen: set[str] = set()
    prompts: list[str] = []
    attempts = 0
    while len(prompts) < n_unique:
        attempts += 1
        if attempts > 50 * n_prompts + 1000:
            raise RuntimeError(f"could not generate {n_unique} unique prompts")
        text = generate(rng)
        if text not in seen:
            seen.add(text)
            prompts.append(text)
    for _ in range(n_dupes):
        # Insert a copy after its original so both survive in order.
        src = rng.randrange(len(prompts))
        prompts.insert(rng.randint(src + 1, len(prompts)), prompts[src])
    return prompts


# ------------------------------------------------------------------------- tokenizer


def _train_tokenizer(prompts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE as ggk's Qwen2 tokenizer rebuilds one from its merges alone (ggk_contract): Qwen2's
    pre-tokenizer, the 256 byte symbols in bytes_to_unicode order, then one id per merge, then EOS. So the
    tokenizer pack written beside the adapter gives ggk the same ids."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=byte_symbols(),
        show_progress=False,
    )
    # BPE training proved deterministic across processes and thread counts, but run it
    # serially anyway (tokenizers re-reads this variable on every call, unlike
    # RAYON_NUM_THREADS) so output never hinges on thread scheduling; restored after.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        # Sorted input so training never depends on prompt order.
        tok.train_from_iterator(sorted(set(prompts)), trainer=trainer)
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_from_merges(merges, specials=[EOS_TOKEN]),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )


# ---------------------------------------------------------------------------- models


def _derived_seed(seed: int, purpose: str) -> int:
    digest = hashlib.sha256(f"gguf_assets.demo:{seed}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _seeded_init(
    model_cls: type[_Model], config: PreTrainedConfig, seed: int
) -> _Model:
    """Instantiate ``model_cls(config)`` with a seeded init, restoring global RNG state."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def _build_teacher(
    tokenizer: PreTrainedTokenizerFast, seed: int, student_embeddings: torch.Tensor | None
) -> Qwen3MoeForCausalLM:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEACHER_HIDDEN_SIZE,
        num_hidden_layers=TEACHER_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=128,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    teacher = _seeded_init(Qwen3MoeForCausalLM, config, _derived_seed(seed, "teacher"))
    # The teacher reads the prompt through a fixed linear lift of the student's token
    # embeddings (V x 48 -> V x 64), so what the teacher sees of each token is a linear
    # function of what the student's layer 0 holds: the same tokenizer *and* a shared token
    # space, as when a student is cut down from its teacher. Independent random tables would
    # leave the adapter to memorize a ~400-token lookup through a 48-wide bottleneck.
    # ``None``: the teacher keeps its own table (the independent pair).
    if student_embeddings is not None:
        with torch.no_grad():
            teacher.get_input_embeddings().weight.copy_(_lift(student_embeddings, seed))
    return teacher


def _lift(student_embeddings: torch.Tensor, seed: int) -> torch.Tensor:
    """student embeddings [V, Ds] @ P [Ds, D], P ~ N(0, 1/Ds): rows keep the embedding scale."""
    gen = torch.Generator().manual_seed(_derived_seed(seed, "embedding_lift"))
    ds = student_embeddings.shape[1]
    lift = torch.randn((ds, TEACHER_HIDDEN_SIZE), generator=gen, dtype=torch.float32) / ds**0.5
    return (student_embeddings.detach().float() @ lift).contiguous()


def _build_student(tokenizer: PreTrainedTokenizerFast, seed: int, *, hidden_size: int = STUDENT_HIDDEN_SIZE,
                   layers: int = STUDENT_LAYERS, initializer_range: float = INITIALIZER_RANGE,
                   residual_scale: float = 1.0) -> Qwen3ForCausalLM:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        # ggk fixes the head dim, the RMSNorm eps and the rope theta (ggk_contract), so the demo's student
        # has ggk's: two heads of 128 over a 48-wide stream.
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=STUDENT_HEAD_DIM,
        rms_norm_eps=STUDENT_RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": STUDENT_ROPE_THETA},
        intermediate_size=2 * hidden_size,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    student = _seeded_init(Qwen3ForCausalLM, config, _derived_seed(seed, "student"))
    if residual_scale != 1.0:
        with torch.no_grad():  # each layer's writes to the residual stream (attention and MLP outputs) scaled
            for layer in student.model.layers:
                layer.self_attn.o_proj.weight.mul_(residual_scale)
                layer.mlp.down_proj.weight.mul_(residual_scale)
    return student


PRETRAIN_BATCH = 32
PRETRAIN_LEARNING_RATE = 3e-3


def _pretrain(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str], steps: int,
              seed: int) -> float:
    """Next-token training on the prompts (each followed by EOS): AdamW, warmup then cosine, batches drawn
    with the model's own seed (two models trained "separately" see different orders). Returns the mean
    loss of the last tenth of the steps."""
    import math

    rows = [tokenizer(text).input_ids + [tokenizer.eos_token_id] for text in sorted(set(prompts))]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LEARNING_RATE, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(steps):
        lr = PRETRAIN_LEARNING_RATE * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = [rows[i] for i in torch.randint(len(rows), (PRETRAIN_BATCH,), generator=generator).tolist()]
        longest = max(len(r) for r in batch)
        ids = torch.full((len(batch), longest), tokenizer.pad_token_id)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    tail = losses[-max(1, steps // 10):]
    return sum(tail) / len(tail)


def _query_rows(seed: int, n_rows: int) -> torch.Tensor:
    # Private generator: no global RNG side effects.
    gen = torch.Generator().manual_seed(_derived_seed(seed, "query_rows"))
    rows = torch.randn((n_rows, TEACHER_HIDDEN_SIZE), generator=gen, dtype=torch.float32)
    return (rows * QUERY_ROW_SCALE).contiguous()


# --------------------------------------------------------------------------- writing


def _write_dataset(dataset_dir: Path, prompts: list[str], *, seed: int) -> None:
    dataset_dir.mkdir(parents=True)
    with open(dataset_dir / PROMPTS_FILENAME, "w", encoding="utf-8", newline="\n") as fh:
        for text in prompts:
            fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    n_dupes = len(prompts) - len(set(prompts))
    lengths = sorted(len(p.split()) for p in prompts)
    # The card keeps the module path it was written with (the builder is lib/demo/demo.py now): its bytes enter
    # the demo dataset's pin, so any edit would change every fingerprint of a demo built afterwards.
    card = f"""---
pretty_name: gguf_assets demo prompts
language: [en]
license: cc0-1.0
size_categories: [n<10K]
---

# Demo prompts

Synthetic English image-generation prompts for the `gguf_assets` demo project, generated
offline by `gguf_assets.lib.project.demo.build_demo_materials` (seed {seed}) from fixed word
lists and templates. They carry no meaning beyond exercising the pipeline.

## Format

`{PROMPTS_FILENAME}`: one JSON object per line, `{{"text": "<prompt>"}}`, UTF-8.

## Statistics

- prompts: {len(prompts)}
- exact duplicates (deliberate, for the dedupe step): {n_dupes}
- words per prompt: min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}
"""
    (dataset_dir / "README.md").write_text(card, encoding="utf-8", newline="\n")


def _save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path
) -> None:
    quiet_libraries()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _install(staged: Path, final: Path, trash: Path) -> None:
    """Move ``staged`` to ``final``; an existing ``final`` is moved aside first."""
    if final.exists():
        os.replace(final, trash / final.name)
    os.replace(staged, final)


def build_demo_materials(
    root: Path, *, seed: int = 0, n_prompts: int = 2000, query_rows: int = 256,
    student_hidden_size: int = STUDENT_HIDDEN_SIZE, student_layers: int = STUDENT_LAYERS, independent: bool = False,
    pretrain_steps: int = 0,
) -> DemoMaterials:
    """Build the demo teacher, student and dataset under ``root`` (no network).

    Same ``seed`` and options give byte-identical files. Existing ``teacher``,
    ``student`` and ``dataset`` folders under ``root`` are replaced. ``student_hidden_size``
    and ``student_layers`` give students of other shapes (benchmarks/bench_quality.py); the
    teacher's token embeddings are a lift of whichever student's.

    ``independent``: a pair this builder does not shape (bench_quality's family C), as two separately
    trained models would be: the teacher keeps its own random token table, the student's weights are
    drawn on their own at twice the scale (INDEPENDENT_STUDENT_INIT, so its layers differ more from its
    embeddings), and the prompts come from a scene grammar of their own. Nothing ties the student's
    layer 0 to what the teacher reads.

    ``pretrain_steps``: then train the teacher and the student, each on its own, as language models on the
    prompts for that many steps (``_pretrain``; family D), so that their layers carry what the grammar
    teaches (word order, which words go together), as a real model's do and a random one's cannot.
    Byte-identical for the same seed and torch thread count.
    """
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    if query_rows < 1:
        raise ValueError(f"query_rows must be >= 1, got {query_rows}")
    if student_hidden_size < 1 or student_layers < 1:
        raise ValueError(f"student_hidden_size and student_layers must be >= 1, got {student_hidden_size}, "
                         f"{student_layers}")
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    prompts = _with_duplicates(random.Random(seed), n_prompts, _scene_prompt if independent else _demo_prompt)
    tokenizer = _train_tokenizer(prompts)
    logger.info("demo tokenizer: %d tokens from %d prompts", len(tokenizer), len(prompts))

    # Stage everything under root so the final moves are same-filesystem renames.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        staged = tmp / "staged"
        staged.mkdir()
        student = _build_student(tokenizer, seed, hidden_size=student_hidden_size, layers=student_layers,
                                 initializer_range=INDEPENDENT_STUDENT_INIT if independent else INITIALIZER_RANGE,
                                 residual_scale=1.0 if independent else STUDENT_RESIDUAL_SCALE)
        teacher = _build_teacher(tokenizer, seed, None if independent else student.get_input_embeddings().weight)
        if pretrain_steps:
            for name, model in (("teacher", teacher), ("student", student)):
                loss = _pretrain(model, tokenizer, prompts, pretrain_steps, _derived_seed(seed, f"pretrain-{name}"))
                logger.info("demo %s pretrained for %d steps: next-token loss %.3f", name, pretrain_steps, loss)
        _save_model(teacher, tokenizer, staged / "teacher")
        save_file(
            {QUERY_ROWS_TENSOR: _query_rows(seed, query_rows)},
            str(staged / "teacher" / QUERY_ROWS_FILENAME),
            metadata={"format": "pt"},
        )
        _save_model(student, tokenizer, staged / "student")
        _write_dataset(staged / "dataset", prompts, seed=seed)
        build_demo_sigvq(staged / "sigvq", seed)

        trash = tmp / "trash"
        trash.mkdir()
        for name in ("teacher", "student", "dataset", "sigvq"):
            _install(staged / name, root / name, trash)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    logger.info("demo materials written under %s (seed %d)", root, seed)
    return DemoMaterials(
        teacher_dir=root / "teacher", student_dir=root / "student", dataset_dir=root / "dataset",
        sigvq_dir=root / "sigvq",
    )


def iter_prompts(dataset_dir: Path) -> Iterator[str]:
    """Yield the ``text`` of each line of ``dataset_dir/prompts.jsonl``."""
    with open(Path(dataset_dir) / PROMPTS_FILENAME, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)["text"]


# A quarter of the demo's prompts in as many shards (4 train, 1 val), for replace(demo_settings(), **QUARTER_SIZES):
# the tests' projects and the quick benchmarks', whose shard, resume and partition logic sees the demo's counts
# while the teacher and student passes and each validation read a quarter of the text, and whose adapter has one
# head (64 wide: a quarter of the demo's training compute).
QUARTER_SIZES = {"corpus": {"train_prompts": 400, "val_prompts": 100},
                 "precompute": {"shard_size": 100, "val_shard_size": 100},
                 "training": {"width": 64}}


def demo_settings(*, steps: int = DEMO_STEPS, mock_teacher: bool = False):
    """The demo project's settings: the trainer8 recipe scaled down to minutes on 2 CPU cores.

    Material paths are relative to the project folder, so the project can be moved. The
    student is read as ggk reads it (its final-norm states over ggk's LLaDA-Image template), the
    teacher reads the prompt as LLaDA-Image renders it (so both see the template, as the real
    teacher does), and the adapter is small (128 wide: two of ggk's 64-wide heads, 1 block), starting at the
    query rows' means with their own learning rate (CPU_START).
    """
    return Settings(
        materials=Materials(teacher="materials/demo/teacher", student="materials/demo/student",
                            datasets=["materials/demo/dataset"], vision_encoder="materials/demo/sigvq"),
        corpus=Corpus(train_prompts=1600, val_prompts=200, seed=0),
        precompute=Precompute(device="cpu", shard_size=400, val_shard_size=200, student_dtype="bf16",
                              prompt_template=LLADA_IMAGE,
                              teacher_batch=32, token_budget=16384, student_batch=64, mock_teacher=mock_teacher),
        training=Training(width=128, depth=1, steps=steps, batch_size=16, learning_rate=6e-3,
                          warmup_steps=max(1, steps // 10), **CPU_START, device="cpu", log_every=max(1, steps // 20),
                          validate_every=max(1, steps // 4), checkpoint_every=max(1, steps // 4)),
        output=Output(adapter_name="demo-adapter"),
    )


def build_demo_sigvq(folder: Path, seed: int, *, semantic_dim: int = 64) -> Path:
    """A tiny random LLaDA-Image SigVQ checkpoint in ``folder``: ``model.safetensors`` (F32, exactly the
    tensors ggk's SigVQ encoder reads, under their checkpoint names) and a small ``config.json``.

    Sized like ggk's tiny test encoder: hidden 32 (two of ggk's fixed 16 heads), MLP 64, 1 block, patch 16,
    a 4x4 position grid, a 16 x 16 codebook. ``semantic_dim`` must equal the DiT's semantic_feat_dim. No
    torch; the same seed gives byte-identical files. Returns ``folder``.
    """
    import numpy as np
    from safetensors.numpy import save_file

    hidden, mlp, blocks, patch, grid, codebook_size, codebook_dim = 32, 64, 1, 16, 4, 16, 16
    rng = np.random.default_rng(_derived_seed(seed, "sigvq"))
    t: dict[str, np.ndarray] = {}

    def normal(name: str, shape: tuple[int, ...], scale: float, offset: float = 0.0) -> None:
        t[name] = (offset + rng.standard_normal(shape) * scale).astype(np.float32)

    def linear(name: str, out_f: int, in_f: int) -> None:
        normal(f"{name}.weight", (out_f, in_f), 1 / np.sqrt(in_f))
        normal(f"{name}.bias", (out_f,), 0.02)

    normal("visual.patch_embed.proj.weight", (hidden, 3, patch, patch), 1 / np.sqrt(3 * patch * patch))
    normal("visual.patch_embed.proj.bias", (hidden,), 0.02)
    normal("visual.embeddings.position_embedding.weight", (grid * grid, hidden), 0.02)
    for i in range(blocks):
        b = f"visual.blocks.{i}"
        for norm in ("norm1", "norm2"):
            normal(f"{b}.{norm}.weight", (hidden,), 0.1, offset=1.0)
            normal(f"{b}.{norm}.bias", (hidden,), 0.1)
        linear(f"{b}.attn.qkv", 3 * hidden, hidden)
        linear(f"{b}.attn.proj", hidden, hidden)
        linear(f"{b}.mlp.fc1", mlp, hidden)
        linear(f"{b}.mlp.fc2", hidden, mlp)
    normal("vqmodel.quant_conv.weight", (codebook_dim, hidden, 1, 1), 1 / np.sqrt(hidden))
    normal("vqmodel.quant_conv.bias", (codebook_dim,), 0.02)
    normal("vqmodel.quantize.embedding.weight", (codebook_size, codebook_dim), 1.0)
    normal("prior_token_embedding.weight", (codebook_size, semantic_dim), 1.0)
    linear("prior_projector.net.0.proj", semantic_dim, semantic_dim)
    linear("prior_projector.net.2", semantic_dim, semantic_dim)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {"_class_name": "LLaDAImageSigVQModel", "hidden_size": hidden, "intermediate_size": mlp,
              "num_layers": blocks, "patch_size": patch, "image_size": grid * patch, "codebook_size": codebook_size,
              "codebook_dim": codebook_dim, "semantic_dim": semantic_dim}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder
