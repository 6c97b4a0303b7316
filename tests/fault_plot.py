"""One picture per fault run: each task's outcome against time, as Jepsen draws a run.

x is when the task was sent, in seconds from the start of the fault; y is how long it took
to become final (send → its latest attempt's end), on a log scale; the colour is its class
(tests/test_fault_runs.py `outcome_class`). The fault's window is shaded. Plain SVG, so
docs/ can show it without a plotting library.
"""

from __future__ import annotations

import math
from html import escape

CLASS_COLOURS = {
    "ok": "#2e7d32",
    "failed": "#c62828",
    "lost by the broker": "#6a1b9a",
    "lost by the console": "#ef6c00",
    "unknown": "#757575",
}
WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 40
Y_MIN_S, Y_MAX_S = 0.01, 120.0  # 10 ms … 2 min: the runs' tasks time out at 120 s


def _x(at: float, start: float, end: float) -> float:
    return LEFT + (at - start) / max(end - start, 1e-9) * (WIDTH - LEFT - RIGHT)


def _y(seconds: float) -> float:
    seconds = min(max(seconds, Y_MIN_S), Y_MAX_S)
    span = math.log10(Y_MAX_S) - math.log10(Y_MIN_S)
    share = (math.log10(seconds) - math.log10(Y_MIN_S)) / span
    return HEIGHT - BOTTOM - share * (HEIGHT - TOP - BOTTOM)


def outcomes_svg(*, title: str, points: list[tuple[float, float | None, str]],
                 fault: tuple[float, float]) -> str:
    """`points`: (sent at, seconds to final or None if never final, class), times in seconds
    from the fault's start; `fault`: its window (start, end) on the same clock."""
    xs = [p[0] for p in points] + list(fault)
    start, end = math.floor(min(xs)), math.ceil(max(xs))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
           f'<text x="{LEFT}" y="16" font-size="13">{escape(title)}</text>']
    x0, x1 = _x(fault[0], start, end), _x(fault[1], start, end)
    out.append(f'<rect x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 1):.1f}" '
               f'height="{HEIGHT - TOP - BOTTOM}" fill="#fbe9e7"/>')
    for seconds in (0.01, 0.1, 1, 10, 100):
        y = _y(seconds)
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{seconds:g} s</text>')
    step = max(1, round((end - start) / 10))
    for tick in range(start, end + 1, step):
        x = _x(tick, start, end)
        out.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">'
                   f'{tick:+d}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 6}" '
               'text-anchor="middle">sent at, s from the start of the fault (shaded: the '
               'fault); up: send → final, log scale; top row: never final</text>')
    for at, took, kind in points:
        y = TOP + 3 if took is None else _y(took)
        out.append(f'<circle cx="{_x(at, start, end):.1f}" cy="{y:.1f}" r="2" '
                   f'fill="{CLASS_COLOURS[kind]}"/>')
    counts = {kind: sum(1 for p in points if p[2] == kind) for kind in CLASS_COLOURS}
    legend_x = LEFT + 8
    for kind, colour in CLASS_COLOURS.items():
        label = f"{kind} {counts[kind]}"
        out.append(f'<circle cx="{legend_x}" cy="{TOP + 10}" r="4" fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 7}" y="{TOP + 14}">{escape(label)}</text>')
        legend_x += 12 + 6.2 * len(label)
    out.append("</svg>")
    return "\n".join(out) + "\n"
