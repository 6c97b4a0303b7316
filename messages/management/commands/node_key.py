"""`manage.py node_key NODE…`: each node's own signing key (docs/protocol.md "Signatures"),
to be given to that node only, as its REACH_NODE_KEY."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from messages import signing
from roster.models import NODE_ID_RE


class Command(BaseCommand):
    help = ("Print the signing key of each NODE (derived from REACH_SIGNING_KEYS), which that "
            "node signs with and checks the console's messages with.")

    def add_arguments(self, parser):
        parser.add_argument("nodes", nargs="+", metavar="NODE", help="node ids")
        parser.add_argument("--kid", help="the secret to derive from (default: the newest, "
                            "which the console signs with)")

    def handle(self, *args, nodes: list[str], kid: str | None, **options):
        keyring = signing.keyring_for(settings.REACH_SIGNING_KEYS)
        if not keyring:
            raise CommandError("REACH_SIGNING_KEYS is empty: set kid:secret (e.g. "
                               "2026-12:$(openssl rand -hex 32)) in the console's environment "
                               "first, then give each node its key")
        kid = kid or keyring.kids[0]
        if kid not in keyring.kids:
            raise CommandError(f"no secret {kid!r} in REACH_SIGNING_KEYS (it holds "
                               f"{', '.join(keyring.kids)})")
        for node in nodes:
            if not NODE_ID_RE.fullmatch(node):
                raise CommandError(f"{node!r} is not a node id (letters, digits, . _ -)")
            key = keyring.key(kid, node)
            self.stdout.write(f"{node} REACH_NODE_KEY={key.text()}")
