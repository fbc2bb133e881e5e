"""lib/core/units.py: the product's one byte formatter (the studio, `gguf-trainer runs` and the estimate's kept
steps line all write sizes with it)."""

from gguf_assets.lib.core.units import bytes_text


def test_a_size_is_written_in_the_largest_binary_unit_it_reaches_with_one_decimal():
    assert [bytes_text(n) for n in (0, 1023, 1024, 1536, 2**20 - 1, 2**20, 5 * 2**30 // 2, 2**40)] == [
        "0 bytes", "1023 bytes", "1.0 KiB", "1.5 KiB", "1024.0 KiB", "1.0 MiB", "2.5 GiB", "1024.0 GiB"]
