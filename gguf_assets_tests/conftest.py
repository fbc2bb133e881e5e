"""Shared fixtures: the tiny demo materials are built once per session and copied per test."""

import shutil
from pathlib import Path

import pytest

from gguf_assets.lib.demo import build_demo_materials, demo_settings
from gguf_assets.lib.layout import ProjectPaths
from gguf_assets.lib.settings import Settings, replace, write_project_file


@pytest.fixture(scope="session")
def demo_materials_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo-materials")
    build_demo_materials(root, seed=0)
    return root


@pytest.fixture
def make_project(tmp_path, demo_materials_root, monkeypatch):
    """make_project(settings_changes) → ProjectPaths of a fresh demo project with its own DAGSTER_HOME."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # restored after the test; runner re-points it
    monkeypatch.setenv("GGUF_ASSETS_PROJECT", str(tmp_path))
    counter = {"n": 0}

    def make(steps: int = 120, mock_teacher: bool = False, **changes) -> ProjectPaths:
        counter["n"] += 1
        root = tmp_path / f"project{counter['n']}"
        shutil.copytree(demo_materials_root, root / "materials" / "demo")
        settings: Settings = replace(demo_settings(steps=steps, mock_teacher=mock_teacher), **changes)
        write_project_file(root, settings)
        return ProjectPaths.of(root)

    return make
