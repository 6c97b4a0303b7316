"""What the list pages (the timeline, the task list) read from a URL and how they stream an
export: shared, so both pages read their filters and cursors the same way."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Iterator

from messages.selectors import FilterError

FILTER_PARAMS = ("status", "type", "direction", "agent", "node", "namespace", "conversation",
                 "task", "q", "error", "since", "until")


def page_cursor(get) -> int | None:
    raw = (get.get("before") or "").strip()
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise FilterError(f"before={raw[:40]!r} is not a row id: follow the page's \"Older\" "
                          "link, or leave it out for the newest rows.")
    return int(raw)


def filter_form(get) -> dict:
    """The filter form as the URL has it, shown back even when it cannot be read."""
    values = {name: (get.get(name) or "")[:265] for name in FILTER_PARAMS if name != "status"}
    values["statuses"] = [s.strip().upper() for v in get.getlist("status") for s in v.split(",")]
    return values


# A spreadsheet runs a cell that starts with one of these as a formula; payloads and error
# texts come from the bus.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return "'" + value if value.startswith(FORMULA_START) else value


def export_chunks(pages: Iterable[list], *, fields: tuple[str, ...],
                  exported: Callable[[object], dict], kind: str) -> Iterator[str]:
    """An export's text, a keyset page at a time: CSV with a header, or JSON lines, of
    `fields` of each row as `exported` shows it."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    if kind == "csv":
        writer.writerow(fields)
    for rows in pages:
        for row in rows:
            data = exported(row)
            if kind == "csv":
                writer.writerow([csv_cell(data[name]) for name in fields])
            else:
                buffer.write(json.dumps({name: data[name] for name in fields},
                                        ensure_ascii=False) + "\n")
        yield buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
    if kind == "csv" and buffer.tell():  # the header of an empty export
        yield buffer.getvalue()
