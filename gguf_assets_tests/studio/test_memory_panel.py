"""The studio's Memory panel is `gguf-trainer estimate`: the same lines, from the hub before any download, and
one line when the hub is out of reach (no browser: the view the page renders)."""

from conftest import free_port

from gguf_assets.lib.planning.estimate import estimate, size_text
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.studio.app import memory_view


def test_the_memory_panel_answers_for_hub_ids_before_any_download(make_project, loopback_hub):
    paths = make_project(materials={"teacher": "demo/teacher", "student": "demo/student"},
                         precompute={"mock_teacher": False})
    view = memory_view(paths)
    expected = estimate(paths, load_settings(paths.root))  # from the .cache the panel filled: no new request
    assert view["lines"] == [{"part": line.part, "size": size_text(line.gib), "how": line.how} for line in expected]
    assert "config.json from the hub at " + loopback_hub.head("demo/teacher")[:12] in view["lines"][0]["how"]
    assert view["peak"] != "?" and view["error"] is None
    assert "model.safetensors" not in loopback_hub.served  # the weights stayed on the hub


def test_the_memory_panel_says_in_one_line_that_the_estimate_needs_the_hub(make_project, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    paths = make_project(materials={"teacher": "org/big-teacher"}, precompute={"mock_teacher": False})
    view = memory_view(paths)
    assert view["peak"] == "?" and view["error"].startswith("the estimate needs the hub for org/big-teacher: ")
    assert "\n" not in view["error"]
