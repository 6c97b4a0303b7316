"""`manage.py rollups_rebuild --hours 24`: count the numbers of the last hours again from
the message rows (after an upgrade from a version that kept none: docs/deployment.md)."""

from __future__ import annotations

from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from messages.rollups import rollups_rebuild


class Command(BaseCommand):
    help = ("Count the per-bucket numbers (overview, stats, alarms) of the last HOURS again "
            "from the message rows.")

    def add_arguments(self, parser):
        parser.add_argument("--hours", type=float, default=24.0,
                            help="how far back, in hours (default 24; stats read 24 h at most)")

    def handle(self, *args, hours: float, **options):
        if not 0 < hours <= 24 * 8:
            raise CommandError("--hours must be more than 0 and at most 192 (the hourly "
                               "numbers are kept 8 days)")
        since = timezone.now() - timedelta(hours=hours)
        read = rollups_rebuild(since=since)
        self.stdout.write(f"counted {read:,} messages since {since:%Y-%m-%d %H:00} UTC again")
