"""The training-curves image labels its axes in the values a user reads, on a log scale for the loss."""

import re

from gguf_assets.lib.telemetry.render import curves_svg


def test_the_loss_panel_is_log_scaled_but_labelled_in_loss_values():
    history = [{"step": 10, "loss": 2.0}, {"step": 20, "loss": 0.5}, {"step": 20, "val_centred_cosine": 0.9},
               {"step": 30, "loss": 0.25}]
    svg = curves_svg(history)
    labels = re.findall(r'<text x="2(?:\.0)?" y="[0-9.]+">([^<]+)</text>', svg)
    assert labels[:2] == ["2", "0.25"], labels  # the loss's own max and min, not log10's 0.301 and -0.602
    assert "loss (log scale)" in svg and "log10" not in svg


def test_a_curve_of_few_points_marks_each_point_and_a_long_one_does_not():
    import xml.etree.ElementTree as ET

    from gguf_assets.lib.telemetry.render import MARKED_POINTS, curves_svg

    few = [{"step": 20, "val_centred_cosine": 0.5}, {"step": 10, "loss": 1.0}, {"step": 20, "loss": 0.8}]
    circles = ET.fromstring(curves_svg(few)).findall("{http://www.w3.org/2000/svg}circle")
    assert len(circles) == 3  # the one validation is visible
    many = [{"step": i, "loss": 1.0 / i} for i in range(1, MARKED_POINTS + 2)]
    assert not ET.fromstring(curves_svg(many)).findall("{http://www.w3.org/2000/svg}circle")


def test_a_sparkline_spans_its_width_and_scales_to_its_maximum():
    import xml.etree.ElementTree as ET

    from gguf_assets.lib.telemetry.render import sparkline_svg

    line = ET.fromstring(sparkline_svg([0.0, 50.0, 100.0, 200.0], maximum=100.0, width=90, height=22)).find(
        "{http://www.w3.org/2000/svg}polyline")
    points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert [x for x, _ in points] == [0.0, 30.0, 60.0, 90.0]
    assert [y for _, y in points] == [21.0, 11.0, 1.0, 1.0]  # 0 at the bottom, the maximum (and above) at the top
    assert ET.fromstring(sparkline_svg([], maximum=100.0)).find("{http://www.w3.org/2000/svg}polyline") is None


def test_the_step_axis_is_labelled_in_whole_steps_when_the_figures_come_as_floats():
    """The studio's live curves read Dagster's metadata, whose numbers are floats: the axis said "1620.0"."""
    history = [{"step": 1500.0, "loss": 1.0}, {"step": 1620.0, "loss": 0.5},
               {"step": 1620.0, "val_centred_cosine": 0.9}]
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', curves_svg(history))
    assert "step 1500" in curves_svg(history) and labels[:2] == ["1620", "1620"], labels
    assert ".0<" not in curves_svg(history)
