"""JSON text for one statement parameter: a batch of rows that PostgreSQL takes apart with
`json_to_recordset` (messages/state.py's inserts, messages/ledger.py's tasks and numbers).

msgspec's encoder, in C: json.dumps of these documents was a fifth of the bridge's ingest
time. Non-ASCII stays as it is (escaped, text of emoji would take three times the space);
times go as RFC 3339 with their offset, which PostgreSQL reads. A value msgspec cannot encode
(text that is not Unicode, which the bus decoder and the API refuse long before this) goes
through the standard library, to fail there as it always did.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import msgspec

_ENCODER = msgspec.json.Encoder()


def json_text(value: Any) -> str:
    try:
        return _ENCODER.encode(value).decode()
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_iso)


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
