"""hub_shapes: a hub model's config and the query rows' header, read from the loopback hub without the weights,
kept in the project's .cache and asked for once."""

import pytest

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.materials import hub_shapes
from gguf_assets.lib.materials.query_rows import QueryRowsError


def test_a_hub_model_is_its_config_and_listing_read_once(tmp_path, loopback_hub, demo_materials_root):
    model = hub_shapes.hub_model(tmp_path, "demo/teacher", skip="query_rows.safetensors")
    assert model.commit == loopback_hub.head("demo/teacher") and (model.folder / "config.json").is_file()
    assert sorted(p.name for p in model.folder.iterdir()) == ["config.json"]  # no weights, no hub working files
    assert model.weight_files == 1 and model.weights_bytes == (demo_materials_root / "teacher" /
                                                               "model.safetensors").stat().st_size
    assert set(loopback_hub.served) == {"config.json"} and model.read_bytes == loopback_hub.served["config.json"]
    before = len(loopback_hub.requests)
    assert hub_shapes.hub_model(tmp_path, "demo/teacher", skip="query_rows.safetensors") == model
    assert len(loopback_hub.requests) == before  # from the cache
    with pytest.raises(UserError, match="not read from the hub yet"):
        hub_shapes.hub_model(tmp_path, "demo/student", ask_hub=False)
    assert len(loopback_hub.requests) == before


def test_the_rows_shape_comes_from_the_header_alone_and_a_wrong_name_lists_candidates(tmp_path, loopback_hub):
    shape, read = hub_shapes.hub_rows_shape(tmp_path, "demo/teacher", "query_rows.safetensors", "query_rows", 64)
    assert shape == [256, 64] and read == loopback_hub.served["query_rows.safetensors"] < 1024
    assert hub_shapes.hub_rows_shape(tmp_path, "demo/teacher", "query_rows.safetensors", "query_rows", 64) == (
        [256, 64], 0)  # from the cache
    with pytest.raises(QueryRowsError, match=r"'nope' is not in demo/teacher:query_rows.safetensors") as err:
        hub_shapes.hub_rows_shape(tmp_path, "demo/teacher", "query_rows.safetensors", "nope", 64)
    assert str(err.value).splitlines()[1:] == ["  query_rows  [256, 64]"]
    assert not (tmp_path / "hub" / "headers").exists()  # the header's working files are gone
