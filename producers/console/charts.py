"""Simple charts as SVG, drawn on the server: no charting library, no script.

Each chart has a title and a description for screen readers, and a table of the same
numbers sits next to it on the page.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup
from markupsafe import escape as esc

__all__ = ["bars"]

_W, _H, _PAD = 640, 180, 28


def bars(title: str, labels: Sequence[str], series: Sequence[tuple[str, Sequence[float]]],
         *, limit: float | None = None, limit_label: str = "") -> Markup:
    """Grouped bars, one group per label, one colour per series; ``limit`` draws a line."""
    values = [v for _name, vs in series for v in vs]
    top = max([*values, limit or 0.0, 1e-9])
    n = max(len(labels), 1)
    group = (_W - 2 * _PAD) / n
    width = max(group / max(len(series), 1) - 2, 1)
    parts = []
    for s, (_name, vs) in enumerate(series):
        for i, v in enumerate(vs):
            h = (_H - 2 * _PAD) * v / top
            x = _PAD + i * group + s * (width + 2)
            y = _H - _PAD - h
            parts.append(f'<rect class="s{s}" x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" '
                         f'height="{h:.1f}"><title>{esc(labels[i])}: {v:g}</title></rect>')
    if limit is not None:
        y = _H - _PAD - (_H - 2 * _PAD) * limit / top
        parts.append(f'<line class="limit" x1="{_PAD}" x2="{_W - _PAD}" y1="{y:.1f}" '
                     f'y2="{y:.1f}"/><text x="{_W - _PAD}" y="{y - 4:.1f}" '
                     f'text-anchor="end">{esc(limit_label)}</text>')
    step = max(1, len(labels) // 6)
    for i in range(0, len(labels), step):
        parts.append(f'<text x="{_PAD + i * group:.1f}" y="{_H - 8}">{esc(labels[i])}</text>')
    parts.append(f'<text x="{_PAD}" y="14">max {top:g}</text>')
    legend = " ".join(f'<span class="key s{s}">{esc(name)}</span>'
                      for s, (name, _vs) in enumerate(series))
    desc = "; ".join(f"{name}: {', '.join(f'{v:g}' for v in vs)}" for name, vs in series)
    return Markup(  # noqa: S704 - built from escaped parts above
        f'<figure class="chart"><svg viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="{esc(title)}"><title>{esc(title)}</title><desc>{esc(desc)}</desc>'
        f'<line class="axis" x1="{_PAD}" x2="{_W - _PAD}" y1="{_H - _PAD}" y2="{_H - _PAD}"/>'
        f'{"".join(parts)}</svg><figcaption>{esc(title)} {legend}</figcaption></figure>')
