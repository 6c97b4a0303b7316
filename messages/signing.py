"""Signed envelopes (docs/protocol.md, "Signatures"): an HMAC over the message that only the
console and one node can make.

Every node has its own key, derived from a secret only the console holds:
``node key = HMAC-SHA256(secret, "reachconsole node key v1" NUL nodeId)``. A node is given
its own key and nothing else (``manage.py node_key NODE``), so it can sign as itself and as
nobody else; the console derives any node's key when it needs it, and stores none. A
message is signed with the key of the node at the other end of the console: a node's own
messages with its key (``signature.node`` = its ``originNodeId``), the console's messages to
a node with that node's key (``signature.node`` = the node it goes to), which the node
checks with the key it holds. Shared-secret MACs, not public keys: a node verifies only
what the console sends it, which its own key does, and HMAC costs microseconds a message
with the standard library where signatures of public keys cost a keypair per node to issue,
store and revoke.

What is signed is the RFC 8785 (JSON Canonicalization Scheme) form of the envelope's
``message`` object as it was received, so a node in any language with a JCS library
computes the same bytes.

Keys rotate by secret: REACH_SIGNING_KEYS lists ``kid:secret`` pairs, the first signs, all
verify. Put the new secret first, hand every node its new key (same command), then remove
the old pair. The ``kid`` in each signature says which secret its key came from.

Free of Django, like messages/protocol.py: the bridge, the tests' nodes and any tool use it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import rfc8785

ALG = "HMAC-SHA256"
KID_RE = re.compile(r"[A-Za-z0-9._-]{1,32}")
MIN_SECRET_CHARS = 32
_NODE_KEY_LABEL = b"reachconsole node key v1\x00"
# A heartbeat is not stored, so its messageId cannot stop a replay after the bridges forget
# it (messages/inbound.py HEARTBEAT_SEEN_S, 60 s): a signed heartbeat older than this, or
# this far ahead of the console's clock, is refused. Clocks on NTP agree to milliseconds.
HEARTBEAT_MAX_SKEW_S = 30


@dataclass(frozen=True, slots=True)
class NodeKey:
    """One node's key: what signs and checks that node's traffic."""

    kid: str
    node_id: str
    key: bytes = b""

    def text(self) -> str:
        """How a node is given its key (REACH_NODE_KEY): ``kid:base64url``."""
        return f"{self.kid}:{_b64(self.key)}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def node_key_derive(*, secret: bytes, kid: str, node_id: str) -> NodeKey:
    key = hmac.new(secret, _NODE_KEY_LABEL + node_id.encode(), hashlib.sha256).digest()
    return NodeKey(kid=kid, node_id=node_id, key=key)


def node_key_parse(text: str, *, node_id: str) -> NodeKey:
    """A node's own key as ``manage.py node_key`` printed it (``kid:base64url``)."""
    kid, sep, encoded = (text or "").strip().partition(":")
    if not sep or not KID_RE.fullmatch(kid):
        raise ValueError("a node key is written kid:key, as `manage.py node_key NODE` prints it")
    try:
        key = _unb64(encoded)
    except (binascii.Error, ValueError):
        raise ValueError("the key part of a node key is not base64url") from None
    if len(key) != 32:
        raise ValueError(f"a node key is 32 bytes; this one is {len(key)}")
    return NodeKey(kid=kid, node_id=node_id, key=key)


class Keyring:
    """The console's secrets (REACH_SIGNING_KEYS), newest first. Empty: nothing is signed
    and nothing can be checked."""

    def __init__(self, secrets: list[tuple[str, bytes]]):
        self._secrets = dict(secrets)
        self.kids = [kid for kid, _ in secrets]

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def signing_key(self, node_id: str) -> NodeKey | None:
        """The key the console signs with for traffic with `node_id` (the newest secret's)."""
        return self.key(self.kids[0], node_id) if self.kids else None

    def key(self, kid: str, node_id: str) -> NodeKey | None:
        secret = self._secrets.get(kid)
        return None if secret is None else _derived(secret, kid, node_id)


class OwnKey:
    """What a node holds: its own key, with which it signs and checks what the console sends
    it (the keyring of signature_check, on a node's side)."""

    def __init__(self, key: NodeKey):
        self._key = key
        self.kids = [key.kid]

    def key(self, kid: str, node_id: str) -> NodeKey | None:
        return self._key if (kid, node_id) == (self._key.kid, self._key.node_id) else None


@lru_cache(maxsize=65536)
def _derived(secret: bytes, kid: str, node_id: str) -> NodeKey:
    return node_key_derive(secret=secret, kid=kid, node_id=node_id)


def keyring_parse(text: str) -> Keyring:
    """REACH_SIGNING_KEYS: ``kid:secret`` pairs separated by commas, newest first. Raises
    ValueError with words a person can act on."""
    pairs: list[tuple[str, bytes]] = []
    for index, item in enumerate(p.strip() for p in (text or "").split(",")):
        if not item:
            continue
        kid, sep, secret = item.partition(":")
        where = f"REACH_SIGNING_KEYS item {index + 1}"
        if not sep or not KID_RE.fullmatch(kid):
            raise ValueError(f"{where}: write kid:secret, the kid 1 to 32 of A-Z a-z 0-9 . _ -")
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"{where} ({kid}): the secret is {len(secret)} characters; use "
                             f"at least {MIN_SECRET_CHARS} random ones (openssl rand -hex 32)")
        if any(kid == k for k, _ in pairs):
            raise ValueError(f"{where}: kid {kid} is listed twice")
        pairs.append((kid, secret.encode()))
    return Keyring(pairs)


def canonical(message: dict[str, Any]) -> bytes:
    """The bytes a signature covers. Raises ValueError for a message JCS cannot write (an
    integer beyond ±2^53, which JSON numbers in other languages cannot hold exactly)."""
    try:
        return rfc8785.dumps(message)
    except (rfc8785.CanonicalizationError, UnicodeEncodeError) as exc:
        raise ValueError(f"the message cannot be signed: {exc} (RFC 8785 holds integers up "
                         "to 2^53 and text as valid Unicode)") from None


def signature_make(message: dict[str, Any], key: NodeKey) -> dict[str, str]:
    mac = hmac.new(key.key, canonical(message), hashlib.sha256).digest()
    return {"alg": ALG, "kid": key.kid, "node": key.node_id, "value": _b64(mac)}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a message's signature proves. `code`: "signed" (it checks, with the key of the
    node it claims to be from), "unsigned" (it has none), "unchecked" (the console holds no
    key), or a refusal: "bad_signature", "unknown_key", "wrong_node", "malformed",
    "too_old", "no_origin". `words` say it to a person."""

    code: str
    words: str = ""

    @property
    def signed(self) -> bool:
        return self.code == "signed"

    @property
    def refused(self) -> bool:
        return self.code not in ("signed", "unsigned", "unchecked")


SIGNED = Verdict("signed")
UNSIGNED = Verdict("unsigned", "it is not signed")
# The console holds no keys (REACH_SIGNING_KEYS is empty): nothing can be checked.
UNCHECKED = Verdict("unchecked", "the console holds no signing keys")


def signature_check(*, message: dict[str, Any], signature: Any, node_id: str,
                    keyring: Keyring | OwnKey) -> Verdict:
    """Whether `message` was signed with the key of `node_id`, the node it speaks for."""
    if signature is None:
        return UNSIGNED
    if not isinstance(signature, dict) or not all(
            isinstance(signature.get(f), str) for f in ("alg", "kid", "node", "value")):
        return Verdict("malformed", "its signature is not an object of strings alg, kid, "
                       "node and value")
    if signature["alg"] != ALG:
        return Verdict("malformed", f"its signature's alg is {signature['alg'][:40]!r}; the "
                       f"console checks {ALG}")
    if signature["node"] != node_id:
        return Verdict("wrong_node", f"it is signed with the key of node "
                       f"{signature['node'][:128]}, but speaks for node {node_id}")
    key = keyring.key(signature["kid"], node_id)
    if key is None:
        held = ", ".join(keyring.kids) or "none"
        return Verdict("unknown_key", f"it is signed with key {signature['kid'][:40]!r}, "
                       f"which the console does not hold (it holds {held})")
    try:
        mac = _unb64(signature["value"])
        expected = hmac.new(key.key, canonical(message), hashlib.sha256).digest()
    except (binascii.Error, ValueError):
        return Verdict("bad_signature", "its signature does not match its content")
    if not hmac.compare_digest(mac, expected):
        return Verdict("bad_signature", "its signature does not match its content (changed "
                       f"on the way, or not made with node {node_id}'s key)")
    return SIGNED


def heartbeat_age_check(*, timestamp: int | None, now_ms: int) -> Verdict | None:
    """A refusal for a signed heartbeat that could be a replay, or None."""
    if timestamp is None:
        return Verdict("too_old", "a signed heartbeat needs its timestamp, which keeps it "
                       "from being replayed")
    skew_s = (now_ms - timestamp) / 1000
    if abs(skew_s) > HEARTBEAT_MAX_SKEW_S:
        way = "old" if skew_s > 0 else "ahead of the console's clock"
        return Verdict("too_old", f"its timestamp is {abs(skew_s):.0f} s {way} (the bound is "
                       f"{HEARTBEAT_MAX_SKEW_S} s): a replay, or the node's clock is off")
    return None


@lru_cache(maxsize=8)
def keyring_for(text: str) -> Keyring:
    """The keyring of a REACH_SIGNING_KEYS value (checked when settings load)."""
    return keyring_parse(text)


def signature_refusal(verdict: Verdict, *, strict: bool) -> str:
    """Why a message that speaks for a node changes nothing, or "" when it may: a signature
    that does not check is refused always, a missing one only in strict mode."""
    if verdict.refused:
        return verdict.words
    if strict and not verdict.signed:
        return ("it is not signed, and the console takes only signed answers, heartbeats, "
                "DRAINs and requests (REACH_REQUIRE_SIGNED)")
    return ""
