"""The settings each result was made under, kept once per distinct snapshot: <project>/.settings/<hash>.json.

A stage's record (materials and corpus manifests, shard sidecars, the adapter manifest, the
export sidecar, the report) stores only the hash of the settings it was made under. The
snapshot behind the hash serves two things:

- ``status`` says why a stage is stale: the project.yaml keys whose change alters that stage's
  result, old → new (``training.steps 400 → 600``), see ``changed_keys``;
- a pipeline uses one snapshot from start to end: the runs of one `gguf-trainer run` carry the
  hash, and every job loads its settings by it, so an edit of project.yaml during a run only
  affects the next run.

A snapshot holds what project.yaml holds (paths as the user wrote them, relative ones staying
relative), never a secret and never the project folder's own path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.project.settings import Settings, SettingsError, replace, settings_from_dict, shown_setting

SETTINGS_DIR = ".settings"


def settings_hash(settings: Settings) -> str:
    return atomic.fingerprint(settings.to_dict())


def snapshot_file(root: Path, digest: str) -> Path:
    return Path(root) / SETTINGS_DIR / f"{digest}.json"


def remember(root: Path, settings: Settings) -> str:
    """Keep this snapshot (once; atomic) and return its hash, which a record then stores."""
    digest = settings_hash(settings)
    target = snapshot_file(root, digest)
    if recall(root, digest) is None:
        atomic.write_json(target, settings.to_dict())
    return digest


def recall(root: Path, digest: str | None) -> Settings | None:
    """The snapshot behind ``digest``; None when there is none, or it is damaged or does not match its hash."""
    if not digest:
        return None
    try:
        raw = atomic.read_json(snapshot_file(root, digest))
        settings = settings_from_dict(raw)
    except (OSError, ValueError, SettingsError):
        return None
    return settings if settings_hash(settings) == digest else None


def _flat(values: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text if text != "" else '""'
    return text if len(text) <= 60 else text[:57] + "..."


def changed_keys(old: Settings, new: Settings, result_of: Callable[[Settings], object]) -> list[str]:
    """The project.yaml keys whose change from ``old`` to ``new`` alters ``result_of`` (a stage's
    settings slice), each as "key old → new"; [] when that slice is the same.

    A key counts when changing it alone alters the slice; if only a combination does, every
    changed key is listed.
    """
    before = result_of(old)
    if result_of(new) == before:
        return []
    flat_old, flat_new = _flat(old.to_dict()), _flat(new.to_dict())
    changed = [k for k in flat_new if flat_old.get(k) != flat_new[k]] + [k for k in flat_old if k not in flat_new]
    if not changed:
        return []

    def alone(key: str) -> Settings:
        section, _, field = key.partition(".")
        field = field.split(".", 1)[0]
        return replace(old, **{section: {field: getattr(getattr(new, section), field)}})

    counted = [k for k in changed if result_of(alone(k)) != before] or changed
    return [f"{k} {_show(shown_setting(k, flat_old.get(k)))} → {_show(shown_setting(k, flat_new.get(k)))}"
            for k in counted]
