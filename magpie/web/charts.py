"""Line charts drawn as inline SVG on the server: the dashboard loads no script or file for them.

:func:`line_chart` takes one or more series of ``(t_ms, value or None)`` points on a shared time axis;
``None`` leaves a gap. Text is escaped; the output is one ``<svg>`` element.
"""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape

COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea")


def _clock(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%H:%M:%S")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.1f}"
    return f"{v:.3g}"


def line_chart(series: dict[str, list[tuple[float, float | None]]], *, title: str, unit: str = "",
               width: int = 640, height: int = 180) -> str:
    """An SVG line chart.

    Args:
        series: label -> points ``(t_ms, value)`` (Unix ms; value None = no data), at most 4 series.
        title: shown top left; unit: appended to the y-axis labels (e.g. ``"/s"``, ``" s"``).
        width / height: pixels.
    Returns:
        SVG markup (escaped text); "no data yet" when no point has a value.
    """
    left, right, top, bottom = 56, 12, 26, 24
    pw, ph = width - left - right, height - top - bottom
    pts = [(t, v) for s in series.values() for t, v in s if v is not None]
    head = (f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
            f'<text x="4" y="16" class="chart-title">{escape(title)}</text>')
    if not pts:
        return head + (f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" class="chart-empty">'
                       'no data yet</text></svg>')
    ts = [t for s in series.values() for t, _ in s]
    t0, t1 = min(ts), max(ts)
    vmax = max(v for _, v in pts)
    vmin = min(0.0, min(v for _, v in pts))
    if vmax == vmin:
        vmax = vmin + 1.0
    span_t = (t1 - t0) or 1.0

    def x(t: float) -> float:
        return left + (t - t0) / span_t * pw

    def y(v: float) -> float:
        return top + ph - (v - vmin) / (vmax - vmin) * ph

    parts = [head]
    for frac in (0.0, 0.5, 1.0):  # grid lines and y labels
        v = vmin + frac * (vmax - vmin)
        yy = y(v)
        parts.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{left + pw}" y2="{yy:.1f}" class="chart-grid"/>'
                     f'<text x="{left - 4}" y="{yy + 4:.1f}" text-anchor="end" class="chart-label">'
                     f'{escape(_fmt(v) + unit)}</text>')
    parts.append(f'<text x="{left}" y="{height - 6}" class="chart-label">{_clock(t0)}</text>'
                 f'<text x="{left + pw}" y="{height - 6}" text-anchor="end" class="chart-label">'
                 f'{_clock(t1)} UTC</text>')
    lx = 4 + 7 * len(title) + 24  # legend right of the title
    for i, (label, points) in enumerate(list(series.items())[: len(COLORS)]):
        color = COLORS[i]
        runs: list[list[str]] = [[]]
        for t, v in points:
            if v is None:
                runs.append([])
            else:
                runs[-1].append(f"{x(t):.1f},{y(v):.1f}")
        for run in runs:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{color}"/>')
            elif run:
                parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                             f'points="{" ".join(run)}"/>')
        parts.append(f'<rect x="{lx}" y="{top - 15}" width="10" height="3" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{top - 10}" class="chart-legend">{escape(label)}</text>')
        lx += 14 + 7 * len(label) + 16
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["line_chart"]
