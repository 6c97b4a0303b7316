"""`{{ when|moment:"H:i:s" }}`: a time as the page shows it, in UTC, marked up so that a
viewer who chose local time sees it in theirs (static/js/times.js), with UTC on hover.

The format is Django's date format, plus `v` for milliseconds (`H:i:s.v`). A builtin of
the templates (settings.TEMPLATES), as `date` is.
"""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils import dateformat, timezone
from django.utils.html import format_html

register = template.Library()


def _text(moment: datetime, fmt: str) -> str:
    # `v` (milliseconds) is not one of Django's: each part is formatted, then joined.
    millis = f"{moment.microsecond // 1000:03d}"
    return millis.join(dateformat.format(moment, part) for part in fmt.split("v"))


@register.filter
def moment(value: datetime | None, fmt: str = "Y-m-d H:i:s") -> str:
    if value is None:
        return ""
    value = timezone.localtime(value) if timezone.is_aware(value) else value
    return format_html('<time datetime="{}" data-format="{}">{}</time>', value.isoformat(),
                       fmt, _text(value, fmt))


@register.simple_tag
def tz_label() -> str:
    """The zone the page's times are in, where words name it ("from 12:00 to 12:05 UTC"):
    turned into the viewer's own with the times."""
    return format_html('<span data-tz>{}</span>', "UTC")
