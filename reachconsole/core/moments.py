"""Moments people type into the console's filters: every page speaks UTC."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_moment(value: str) -> datetime:
    """An ISO 8601 date-time as an aware moment in UTC; without an offset it is UTC.

    ValueError when it is not one, or when it leaves the calendar once converted (year 1 or
    9999 with an offset): refused here, with the filter's own words, rather than failing
    later in the database conversion as a 500."""
    try:
        moment = datetime.fromisoformat(value)
        moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
        return moment.astimezone(UTC)
    except OverflowError as exc:
        raise ValueError(str(exc)) from None
