"""What the UI and the reports show as pictures: the training curves and the live sparklines as inline SVG
(the Markdown tables are lib/core/markdown.py's)."""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from html import escape

from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE, VAL_LOSS

# Series with at most this many points get a marker at each (a single validation is otherwise invisible).
MARKED_POINTS = 30


PAD = 34  # room for the y labels left of a panel


def _svg_open(width: int, height: int) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">',
            f'<rect width="{width}" height="{height}" fill="white"/>']


def _panel(out: list[str], x0: int, title: str, series: list[tuple[str, str, list[tuple[float, float]]]], *,
           panel_width: int, panel_height: int, log_y: bool = False) -> None:
    """One chart at ``x0``: each of ``series`` (label, colour, (x, y) points) as a line, labelled at the right.
    ``log_y``: the points' y are log10 of the values, and the y labels show the values."""
    pad = PAD
    every = [xy for _, _, pts in series for xy in pts]
    out.append(f'<text x="{x0 + pad}" y="12">{title}</text>')
    out.append(f'<rect x="{x0 + pad}" y="18" width="{panel_width - pad - 8}" height="{panel_height - 36}" '
               'fill="none" stroke="#999"/>')
    if not every:
        return
    sx0, sx1 = min(x for x, _ in every), max(x for x, _ in every)
    sy0, sy1 = min(y for _, y in every), max(y for _, y in every)
    if sy1 - sy0 < 1e-9:
        sy0, sy1 = sy0 - 0.5, sy1 + 0.5

    def xy(x: float, y: float) -> str:
        px = x0 + pad + (x - sx0) / max(1e-9, sx1 - sx0) * (panel_width - pad - 8)
        py = 18 + (1 - (y - sy0) / (sy1 - sy0)) * (panel_height - 36)
        return f"{px:.1f},{py:.1f}"

    # A log panel is drawn in log10 but labelled in the values themselves (a loss of 0.31, not -0.509).
    shown = (lambda v: 10 ** v) if log_y else (lambda v: v)
    out.append(f'<text x="{x0 + 2}" y="24">{shown(sy1):.3g}</text>'
               f'<text x="{x0 + 2}" y="{panel_height - 18}">{shown(sy0):.3g}</text>')
    out.append(f'<text x="{x0 + pad}" y="{panel_height - 6}">step {_step_text(sx0)}</text>'
               f'<text x="{x0 + panel_width - 8}" y="{panel_height - 6}" text-anchor="end">{_step_text(sx1)}</text>')
    for i, (label, colour, pts) in enumerate(series):
        if len(pts) > 400:  # keep the embedded image small
            pts = pts[:: math.ceil(len(pts) / 400)] + [pts[-1]]
        if pts:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                       f'points="{" ".join(xy(x, y) for x, y in pts)}"/>')
            if len(pts) <= MARKED_POINTS:  # a few validations are points to read, not a line to guess
                out += [f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour}"/>'
                        for cx, cy in (xy(x, y).split(",") for x, y in pts)]
            out.append(f'<text x="{x0 + panel_width - 10}" y="{30 + 12 * i}" text-anchor="end" '
                       f'fill="{colour}">{label}</text>')


def _step_text(step: float) -> str:
    """A step as an integer: live figures come as floats (Dagster's metadata), and "1620.0" is no step."""
    return str(int(step)) if float(step).is_integer() else f"{step:g}"


def curves_svg(history: list[dict], *, panel_width: int = 320, panel_height: int = 180) -> str:
    """Two small line charts as SVG text: training loss (log scale, plus val loss) and val cosines."""
    panels = [("loss (log scale)", [("loss", "#1f77b4", True), (VAL_LOSS, "#ff7f0e", True)]),
              ("val centred cosine", [(VAL_CENTRED_COSINE, "#2ca02c", False),
                                      (EMPTY_PROMPT_COSINE, "#9467bd", False)])]
    width = panel_width * len(panels)
    out = _svg_open(width, panel_height)
    for p, (title, series) in enumerate(panels):
        points = {key: [(e["step"], math.log10(e[key]) if log_y else e[key]) for e in history
                        if isinstance(e.get(key), (int, float)) and math.isfinite(e[key]) and (not log_y or e[key] > 0)]
                  for key, _, log_y in series}
        _panel(out, p * panel_width, title, [(key, colour, points[key]) for key, colour, _ in series],
               panel_width=panel_width, panel_height=panel_height, log_y=all(log_y for _, _, log_y in series))
    out.append("</svg>")
    return "\n".join(out)


# One colour per compared run, in order.
RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def compare_svg(curves: dict[str, list[tuple[float, float]]], *, title: str = "val centred cosine",
                width: int = 640, height: int = 240) -> str:
    """Several runs' curves ({run name: [(step, value)]}) overlaid in one chart, one colour per run."""
    out = _svg_open(width, height)
    series = [(escape(name), RUN_COLOURS[i % len(RUN_COLOURS)],
               [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)])
              for i, (name, points) in enumerate(curves.items())]
    _panel(out, 0, escape(title), series, panel_width=width, panel_height=height)
    out.append("</svg>")
    return "\n".join(out)


def compare_panels_svg(panels: dict[str, dict[str, list[tuple[float, float]]]], *, columns: int = 2,
                       panel_width: int = 420, panel_height: int = 220) -> str:
    """One chart per score ({title: {run name: [(step, value)]}}), ``columns`` to a row, each run in the same
    colour in every chart (its place in the first chart's runs)."""
    names = list(dict.fromkeys(name for by_run in panels.values() for name in by_run))
    colour = {name: RUN_COLOURS[i % len(RUN_COLOURS)] for i, name in enumerate(names)}
    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    out = _svg_open(panel_width * columns, panel_height * rows)
    for i, (title, by_run) in enumerate(panels.items()):
        out.append(f'<g transform="translate(0,{(i // columns) * panel_height})">')
        series = [(escape(name), colour[name], [(x, y) for x, y in points if isinstance(y, (int, float))
                                                and math.isfinite(y)])
                  for name, points in by_run.items()]
        _panel(out, (i % columns) * panel_width, escape(title), series, panel_width=panel_width,
               panel_height=panel_height)
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def curves_markdown(svg: str) -> str:
    """The SVG as a Markdown image with a data: URI.

    Dagster's UI renders Markdown metadata with react-markdown and a rehype-sanitize schema
    that allows the ``data`` protocol for image sources; a file path would be resolved
    against the web server and not found.
    """
    encoded = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f"![loss and val centred cosine](data:image/svg+xml;base64,{encoded})"


def sparkline_svg(values: Sequence[float], *, maximum: float, width: int = 160, height: int = 24,
                  colour: str = "#0b63c4") -> str:
    """A figure's recent readings as a small line from 0 (bottom) to ``maximum`` (top), newest at the right."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}"><rect width="{width}" height="{height}" fill="#f5f7fa"/>']
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if finite and maximum > 0:
        step = width / max(len(finite) - 1, 1)
        points = " ".join(f"{i * step:.1f},{height - 1 - min(v / maximum, 1.0) * (height - 2):.1f}"
                          for i, v in enumerate(finite))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
    out.append("</svg>")
    return "".join(out)
