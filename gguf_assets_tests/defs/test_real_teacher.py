"""The real teacher's published files, served from the loopback hub: LLaDA-Image's text encoder code (three files,
byte for byte), its published configs with every key kept and the sizes made tiny, bf16 weights in shards with an
index (real_llada.py). What a new user meets the first time `materials.teacher: inclusionAI/LLaDA-Image-Turbo` runs:

(a) without materials.trust_remote_code: refused, naming all three code files with their sha256 and the setting,
    no weight byte served;
(b) with it: a report, and the stored targets equal a per-prompt float32 reference;
(c) a modeling file that imports a module the repo does not have: refused before any weight byte;
(d) a new commit that changes only fused_moe_ops.py: the targets' fingerprint moves (they are recomputed), the
    student's does not, and no weight is fetched again;
(e) a second project with the same teacher at the same commit: no weight byte served, its files linked from the
    per-user store; deleting the first project leaves the second whole;
and each check before the weights (a missing config key, a tokenizer that does not load, a missing code file) in
both `run` and `estimate`.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from conftest import cli
from llada_repo import isolated_remote_code
from real_llada import CODE_FILES, HELPER, MODELING, build_real_llada_repo, real_files_or_skip
from real_llada import pipeline_project as _project
from real_llada import pipeline_settings as _settings
from safetensors.torch import load_file

from gguf_assets.lib.core import atomic
from gguf_assets.lib.materials.materials_run import MaterialsError, load_manifest, manifest_is_current
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.precompute.llada_teacher import LLaDAImageTeacher
from gguf_assets.lib.precompute.shards_run import half_fingerprint
from gguf_assets.lib.project.layout import REPORT_JSON
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.status.stages import STAGES
from gguf_assets.orchestration.launching import run_pipeline

REPO = "inclusionAI/LLaDA-Image-Turbo"
ENCODER_FILES = [f"text_encoder/{name}" for name in CODE_FILES]


@pytest.fixture(scope="module")
def real_repo(tmp_path_factory):
    real_files_or_skip()
    return build_real_llada_repo(tmp_path_factory.mktemp("real-llada") / "LLaDA-Image-Turbo")


def _header_bytes(repo, rel: str) -> int:
    with open(repo / rel, "rb") as fh:
        return 8 + struct.unpack("<Q", fh.read(8))[0]


def weight_bytes_served(hub, repo, before: dict | None = None) -> dict[str, int]:
    """{weights file: body bytes served beyond its safetensors header} (a header read by range is no weight)."""
    before = before or {}
    out = {}
    for rel, n in hub.served.items():
        if rel.endswith(".safetensors"):
            beyond = n - before.get(rel, 0) - (_header_bytes(repo, rel) if n - before.get(rel, 0) else 0)
            if beyond > 0:
                out[rel] = beyond
    return out


@pytest.mark.slow
def test_the_real_teacher_from_the_hub_refused_then_run_to_a_report_then_a_second_project_fetches_no_weight(
        tmp_path, real_repo, demo_materials_root, loopback_hub, monkeypatch):
    loopback_hub.add_repo(REPO, real_repo)
    commit = loopback_hub.head(REPO)
    paths = _project(tmp_path / "project", demo_materials_root, _settings(REPO))

    # (a) no trust: refused in the console, every file of the code closure named with its sha256, no weight byte.
    refused = cli("run", str(paths.root))
    console = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Traceback" not in console, console
    for name in ["materials.trust_remote_code", REPO, commit, *ENCODER_FILES]:
        assert name in console, name
    for name in ENCODER_FILES:
        assert atomic.sha256_file(real_repo / name) in console, name
    assert not [f for f in loopback_hub.served if f.endswith(".safetensors")]

    # (b) trust: the whole pipeline to a report.
    write_project_file(paths.root, _settings(REPO, trust_remote_code=True))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.setenv("GGUF_ASSETS_PROJECT", str(paths.root))
    status = run_pipeline(paths, echo=lambda line: None)
    assert {s.stage: s.state for s in status} == dict.fromkeys(STAGES, "current")
    served = set(loopback_hub.served)
    assert not {f for f in served if f.split("/")[0] in ("transformer", "vae", "scheduler")}, served
    manifest = load_manifest(paths)
    assert sorted(manifest.teacher["remote_code"]) == ENCODER_FILES
    report = atomic.read_json(paths.output_dir(load_settings(paths.root)) / REPORT_JSON)
    assert report["val_centred_cosine"] is not None

    # The stored targets against the same text stack run one prompt at a time, unpadded, in float32.
    shard = next(paths.root.glob("shards/val/*"))
    half = atomic.read_json(shard / "teacher.json")
    assert half["teacher_code"] == manifest.teacher["remote_code"]  # every file of the code that ran, hashed
    prompts = [json.loads(line)["text"] for line in (shard / "prompts.jsonl").read_text().splitlines()][:12]
    stored = load_file(str(shard / "teacher.safetensors"))["targets"][:len(prompts)].float()
    with isolated_remote_code(tmp_path / "hf-modules"):
        teacher = LLaDAImageTeacher(paths.located(manifest.teacher["path"]), load_settings(paths.root),
                                    torch.device("cpu"))
        reference = torch.cat([teacher.encode([p]).targets for p in prompts]).float()
    peak = reference.abs().amax(dim=(1, 2), keepdim=True)
    assert float(((stored - reference).abs() / peak).max()) < 2e-3  # f16 storage: about 5e-4 of the peak
    assert float((stored - reference).abs().max()) > 0 or half["dtype"] == "float32"

    # (e) A second project, same teacher, same commit: nothing but the small files' listing crosses the network.
    before = dict(loopback_hub.served)
    second = _project(tmp_path / "second", demo_materials_root, _settings(REPO, trust_remote_code=True))
    with isolated_remote_code(tmp_path / "hf-modules-2"):  # the checks before the weights import its code here
        again = resolve_materials(second, load_settings(second.root))
    assert again.teacher["commit"] == commit
    # Not one byte of any weights file, not even a header: the checks before the weights read the store's copies.
    assert {f: n for f, n in loopback_hub.served.items() if f.endswith(".safetensors") and n != before.get(f)} == {}
    folder, first_folder = second.located(again.teacher["path"]), paths.located(manifest.teacher["path"])
    shard_file = "text_encoder/model-00001-of-00002.safetensors"
    assert (folder / shard_file).stat().st_ino == (first_folder / shard_file).stat().st_ino  # one copy on disk
    # Deleting the first project leaves the second whole: its files are its own links.
    shutil.rmtree(paths.root)
    assert manifest_is_current(second, load_settings(second.root))
    assert atomic.sha256_file(folder / shard_file) == atomic.sha256_file(real_repo / shard_file)


def _files(repo) -> dict[str, bytes]:
    return {p.relative_to(repo).as_posix(): p.read_bytes() for p in sorted(repo.rglob("*")) if p.is_file()}


def _variant(repo, changes: dict[str, bytes | None]) -> dict[str, bytes]:
    """The repo's files with ``changes`` ({path: bytes, or None to leave it out})."""
    files = _files(repo)
    for path, data in changes.items():
        assert path in files, path
        if data is None:
            del files[path]
        else:
            files[path] = data
    return files


def _without_key(repo, key: str) -> bytes:
    config = json.loads((repo / "text_encoder" / "config.json").read_text())
    del config[key]
    return json.dumps(config, indent=2).encode()


@pytest.mark.slow
def test_the_code_closure_and_every_check_before_the_weights_refuse_in_run_and_estimate(
        tmp_path, real_repo, demo_materials_root, loopback_hub, capsys):
    from gguf_assets.lib.planning.estimate import teacher_check

    trusted = _settings(REPO, trust_remote_code=True)
    bad_repos = {
        # (c) the modeling file's relative import, with the module left out of the repo
        "no-helper/LLaDA-Image-Turbo": (_variant(real_repo, {f"text_encoder/{HELPER}": None}),
                                        ["text_encoder/fused_moe_ops.py", f"text_encoder/{MODELING}"]),
        # a key the forward reads (the config class would quietly default it to 10000)
        "no-rope-theta/LLaDA-Image-Turbo": (_variant(real_repo, {"text_encoder/config.json": _without_key(
            real_repo, "rope_theta")}), ["text_encoder/config.json", "rope_theta is None"]),
        "bad-tokenizer/LLaDA-Image-Turbo": (_variant(real_repo, {"tokenizer/tokenizer.json": b'{"version": "1.0"'}),
                                            ["tokenizer/ does not load"]),
    }
    with isolated_remote_code(tmp_path / "hf-modules"):
        for repo_id, (files, named) in bad_repos.items():
            loopback_hub.add_repo(repo_id, files)
            paths = _project(tmp_path / repo_id.split("/")[0], demo_materials_root,
                             replace(trusted, materials={"teacher": repo_id}))
            before = dict(loopback_hub.served)
            with pytest.raises(MaterialsError) as refused:  # the materials step of `run`
                resolve_materials(paths, load_settings(paths.root))
            for name in named:
                assert name in str(refused.value), (repo_id, name, str(refused.value))
            assert weight_bytes_served(loopback_hub, real_repo, before) == {}, repo_id
            before = dict(loopback_hub.served)
            checked = teacher_check(paths, load_settings(paths.root))  # what `estimate` prints
            assert checked is not None and not checked[0], (repo_id, checked)
            for name in named:
                assert name in checked[1], (repo_id, name, checked[1])
            assert weight_bytes_served(loopback_hub, real_repo, before) == {}, repo_id

        # What `estimate` prints: the line and a failing exit status, before any weight byte (its own entry point,
        # in this process: a cold `gguf-trainer` would add seconds and test nothing more).
        from gguf_assets.cli import main as trainer_main

        capsys.readouterr()
        assert trainer_main(["estimate", str(tmp_path / "no-rope-theta")]) == 1
        printed = capsys.readouterr()
        assert "Traceback" not in printed.err and "text_encoder/config.json" in printed.out
        assert "teacher: materials.teacher = 'no-rope-theta/LLaDA-Image-Turbo'" in printed.out
        assert "rope_theta is None" in printed.out

        # (d) A new commit that changes only fused_moe_ops.py: the teacher's targets are stale, the student's are not,
        # and the weights of the new commit come from the store, not the hub.
        loopback_hub.add_repo(REPO, real_repo)
        paths = _project(tmp_path / "project", demo_materials_root, trusted)
        settings = load_settings(paths.root)
        first = resolve_materials(paths, settings)
        assert sorted(first.teacher["remote_code"]) == ENCODER_FILES
        ok = teacher_check(paths, settings)
        assert ok is not None and ok[0] and "3 code file(s)" in ok[1], ok
        before = {half: half_fingerprint(half, settings, first, "prompts") for half in ("teacher", "student")}
        served = dict(loopback_hub.served)
        helper = (real_repo / "text_encoder" / HELPER).read_bytes() + b"\n# a fix upstream\n"
        commit = loopback_hub.push(REPO, {f"text_encoder/{HELPER}": helper})
        write_project_file(paths.root, replace(trusted, materials={"teacher": f"{REPO}@{commit}"}))
        settings = load_settings(paths.root)
        second = resolve_materials(paths, settings)
        after = {half: half_fingerprint(half, settings, second, "prompts") for half in ("teacher", "student")}
        changed = {f for f in ENCODER_FILES if first.teacher["remote_code"][f] != second.teacher["remote_code"][f]}
        assert changed == {f"text_encoder/{HELPER}"}
        assert after["teacher"] != before["teacher"] and after["student"] == before["student"]
        assert weight_bytes_served(loopback_hub, real_repo, served) == {}
