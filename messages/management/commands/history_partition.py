"""Partition the message history of a database migrated with REACH_PARTITIONS=off, or put
it back into one table (`--undo`). The migration does the same on its first run; this is
for a deployment that chose one table then and wants partitions now (docs/scaling.md,
"Moving an existing history")."""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from django.utils import timezone

from messages import partitions


class Command(BaseCommand):
    help = "Turn the message history into time partitions in place (or back, with --undo)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--undo", action="store_true",
                            help="copy every row back into one table each (slow: a full copy)")

    def handle(self, *args, undo: bool = False, **options) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("partitions are PostgreSQL's; this database keeps one table")
        partitions.partitioned_forget()
        if partitions.history_partitioned() != undo:
            raise CommandError("the history is already partitioned" if not undo
                               else "the history is already one table")
        started = time.monotonic()
        with transaction.atomic(), connection.cursor() as cursor:
            # Writers wait behind the locks from here to the commit.
            cursor.execute("SET LOCAL lock_timeout = '10s'")
            if undo:
                partitions.history_unpartition(cursor)
            else:
                partitions.history_partition(cursor, now=timezone.now())
        partitions.partitioned_forget()
        self.stdout.write(f"{'one table again' if undo else 'partitioned'} in "
                          f"{time.monotonic() - started:.1f} s")
