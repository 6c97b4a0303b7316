"""Small charts drawn by the server: the geometry of an inline SVG, rendered by
templates/overview/_chart.html. No script and no charting library: a chart is part of the
HTML the live partial swaps in, so it is as fresh as the numbers beside it, and every value
reaches the template as a number (auto-escaped text, never markup built here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

WIDTH, HEIGHT = 240, 44
# Room above the tallest bar so a peak does not touch the frame.
HEADROOM = 0.9


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class Line:
    name: str
    # One "x,y x,y …" string per unbroken run: a bucket without a value breaks the line
    # instead of drawing it down to zero.
    runs: list[str]


@dataclass(frozen=True)
class Chart:
    title: str  # what it shows, read out by screen readers (<title>)
    summary: str  # its values in words (<desc>, and the hover text)
    width: int = WIDTH
    height: int = HEIGHT
    top: float = 0.0  # the value at the top of the frame
    bars: list[Bar] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.top <= 0


def _scale(values: Sequence[float | None]) -> float:
    return max((v for v in values if v is not None), default=0.0)


def bar_chart(values: Sequence[float], *, title: str, summary: str, width: int = WIDTH,
              height: int = HEIGHT) -> Chart:
    """One bar per value, oldest first; a zero has no bar."""
    top = _scale(values)
    slot = width / max(len(values), 1)
    gap = min(1.0, slot / 4)
    bars = []
    if top > 0:
        for i, value in enumerate(values):
            if value and value > 0:
                h = max(1.0, value / top * height * HEADROOM)
                bars.append(Bar(x=round(i * slot + gap / 2, 2), y=round(height - h, 2),
                                width=round(slot - gap, 2), height=round(h, 2)))
    return Chart(title=title, summary=summary, width=width, height=height, top=top, bars=bars)


def line_chart(series: dict[str, Sequence[float | None]], *, title: str, summary: str,
               width: int = WIDTH, height: int = HEIGHT) -> Chart:
    """One line per named series, on one scale; each value at the middle of its slot."""
    top = max((_scale(values) for values in series.values()), default=0.0)
    lines = []
    for name, values in series.items():
        slot = width / max(len(values), 1)
        runs, run = [], []
        for i, value in enumerate(values):
            if value is None:
                if run:
                    runs.append(" ".join(run))
                run = []
                continue
            y = height - (value / top * height * HEADROOM if top > 0 else 0.0)
            run.append(f"{round(i * slot + slot / 2, 2)},{round(y, 2)}")
        if run:
            runs.append(" ".join(run))
        # A run of one point is drawn as a short flat line, so a lone value still shows.
        runs = [r if " " in r else _widen(r) for r in runs]
        lines.append(Line(name=name, runs=runs))
    return Chart(title=title, summary=summary, width=width, height=height, top=top,
                 lines=lines)


def _widen(point: str) -> str:
    x, y = (float(v) for v in point.split(","))
    return f"{round(x - 1.5, 2)},{y} {round(x + 1.5, 2)},{y}"
