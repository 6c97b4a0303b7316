"""The A2A wire contract (shared/PROTOCOL.md): envelope codec and MQTT topic names.

Free of Django (the standard library, msgspec, and messages/signing.py for signatures) so that the
MQTT bridge, the tests and any tool can use it without settings. ``decode`` sits on the
bridge's hot path and is fed whatever arrives on the bus, so it never raises: every input
ends as an ``Envelope`` or a ``Rejection`` whose ``reason`` the caller counts and whose
``detail`` a person can act on.

Numeric versions: ``"version": 1.0`` (a JSON number) is rejected as BAD_VERSION. The
contract says the version is a string, and a number cannot tell ``1.10`` from ``1.1``;
failing loudly points the sender's author at the bug instead of hiding it on our side.
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from messages import signing
from reachconsole.core.jsonsafe import WORDS, unstorable

PROTOCOL = "a2a"
VERSION = "1.0"
SUPPORTED_MAJOR = 1

DEFAULT_MAX_BYTES = 262144
MAX_MESSAGE_ID_CHARS = 200
MAX_NODE_ID_CHARS = 128


class MessageType(enum.StrEnum):
    TASK_REQUEST = "TASK_REQUEST"
    TASK_RESPONSE = "TASK_RESPONSE"
    ACK = "ACK"
    NACK = "NACK"
    BUSY = "BUSY"
    EVENT = "EVENT"
    HEARTBEAT = "HEARTBEAT"
    DRAIN = "DRAIN"
    # The console asks a node to stop a task it sent (headers.cancelFor = the taskId);
    # optional for receivers: one that does not know it ignores it.
    CANCEL = "CANCEL"


class Reject(enum.StrEnum):
    TOO_LARGE = "too_large"
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    WRONG_PROTOCOL = "wrong_protocol"
    BAD_VERSION = "bad_version"
    NO_MESSAGE = "no_message"
    MISSING_MESSAGE_ID = "missing_message_id"
    MISSING_MESSAGE_TYPE = "missing_message_type"
    UNKNOWN_MESSAGE_TYPE = "unknown_message_type"
    BAD_FIELD = "bad_field"
    NUL_CHARACTER = "nul_character"
    LONE_SURROGATE = "lone_surrogate"
    NUMBER_OUT_OF_RANGE = "number_out_of_range"
    BAD_NODE_ID = "bad_node_id"


class PayloadTooLarge(ValueError):
    """An encoded envelope is over the size limit; the contract forbids truncating it."""


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: Reject
    detail: str
    # Known once the envelope's shape was read (a rejection for a value inside it): what the
    # message was and which node sent it, so a refused request can be answered. The origin
    # is set only when it is a valid node id: a reply never goes to a topic built from a
    # hostile one.
    message_id: str | None = None
    message_type: MessageType | None = None
    origin_node_id: str | None = None


# (attribute, wire name) of the optional string fields, in wire order.
_OPTIONAL_STR_FIELDS: tuple[tuple[str, str], ...] = (
    ("task_id", "taskId"),
    ("from_agent_id", "fromAgentId"),
    ("to_agent_id", "toAgentId"),
    ("target_node_id", "targetNodeId"),
    ("conversation_id", "conversationId"),
    ("scene_group_id", "sceneGroupId"),
    ("session_id", "sessionId"),
)

_TYPES_BY_VALUE: dict[str, MessageType] = {t.value: t for t in MessageType}
_TYPE_NAMES = ", ".join(_TYPES_BY_VALUE)


def _nonempty_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


MAX_ATTEMPT = 2**31 - 1  # a2a_message.attempt is a 32-bit integer column


def _positive_int(value: Any) -> int | None:
    # bool is an int subclass; `true` is never a count of milliseconds or attempts.
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class Envelope:
    message_id: str
    message_type: MessageType
    task_id: str | None = None
    from_agent_id: str | None = None
    to_agent_id: str | None = None
    target_node_id: str | None = None
    conversation_id: str | None = None
    scene_group_id: str | None = None
    session_id: str | None = None
    timestamp: int | None = None  # epoch milliseconds
    headers: dict[str, Any] = field(default_factory=dict)  # camelCase keys, as on the wire
    payload: Any = None  # any JSON value
    version: str = VERSION
    # As received (decode), not sent: the envelope's `signature`, and its `message` object
    # as it came, which is what the signature covers (messages/signing.py).
    signature: Any = field(default=None, compare=False, repr=False)
    wire_message: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def signature_check(self, *, node_id: str, keyring: signing.Keyring) -> signing.Verdict:
        """Whether this received message was signed with the key of `node_id`."""
        if self.signature is None:
            return signing.UNSIGNED
        return signing.signature_check(message=self.wire_message or self.to_wire()["message"],
                                       signature=self.signature, node_id=node_id,
                                       keyring=keyring)

    # Header accessors read what a peer sent, so a value of the wrong type or an empty
    # string is treated as absent rather than trusted.

    @property
    def idempotency_key(self) -> str:
        # PROTOCOL.md rule 3: without an idempotencyKey the messageId is the dedup key.
        return _nonempty_str(self.headers.get("idempotencyKey")) or self.message_id

    @property
    def origin_node_id(self) -> str | None:
        return _nonempty_str(self.headers.get("originNodeId"))

    @property
    def reply_node_id(self) -> str | None:
        return _nonempty_str(self.headers.get("replyNodeId"))

    @property
    def ack_for(self) -> str | None:
        return _nonempty_str(self.headers.get("ackFor"))

    @property
    def in_reply_to(self) -> str | None:
        return _nonempty_str(self.headers.get("inReplyTo"))

    @property
    def attempt(self) -> int:
        return _positive_int(self.headers.get("attempt")) or 1

    @property
    def timeout_ms(self) -> int | None:
        return _positive_int(self.headers.get("timeoutMs"))

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "messageId": self.message_id,
            "messageType": str(self.message_type),
        }
        for attr, wire in _OPTIONAL_STR_FIELDS:
            message[wire] = getattr(self, attr)
        message["timestamp"] = self.timestamp
        # A copy, so a caller that edits the wire dict cannot change a frozen envelope.
        message["headers"] = dict(self.headers)
        message["payload"] = self.payload
        return {"protocol": PROTOCOL, "version": self.version, "message": message}


def _describe(value: Any) -> str:
    """A short, safe description of a received value for a rejection detail.

    Containers are named, not printed: they may be deep enough to make repr recurse out.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "…"
        return f"the string {shown!r}"
    if isinstance(value, (int, float)):
        try:
            text = repr(value)
        except ValueError:  # int too long to print under sys.int_info's digit limit
            text = "a very long number"
        return f"the number {text[:40]}"
    return type(value).__name__


def describe(value: Any) -> str:
    """A value received, named for the words of a refusal (never the whole value)."""
    return _describe(value)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    # json.loads turns 1e999 into inf, which encode could then never send back out.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of the range of a 64-bit float")
    return value


def _version_is_supported(version: str) -> bool:
    parts = version.split(".")
    for part in parts:
        # isascii: str.isdigit also accepts digits from other scripts, which int() would take.
        if not (part.isascii() and part.isdigit()):
            return False
    return int(parts[0]) == SUPPORTED_MAJOR


def decode(data: bytes | str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Envelope | Rejection:
    """Parse one message from the bus. Never raises, whatever ``data`` is."""
    try:
        return _decode(data, max_bytes)
    # A crash here would take down the bridge's receive loop: nothing may escape.
    except Exception as exc:  # noqa: BLE001
        return Rejection(Reject.BAD_FIELD, f"message could not be read ({type(exc).__name__})")


_OTHER_DIALECT = (
    'a {"header", "payload"} envelope (the Agent-Reach dialect) is not this bus\'s: send '
    f'{{"protocol": "{PROTOCOL}", "version": "{VERSION}", "message": {{"messageId", "type", '
    '"fromAgentId", "toAgentId", "taskId", "headers", "payload", …}} (docs/protocol.md, Envelope)')


def _decode(data: Any, max_bytes: int) -> Envelope | Rejection:
    if isinstance(data, str):
        # Cheap guard first: a str is at least as many UTF-8 bytes as it has characters.
        if len(data) > max_bytes:
            return _too_large(len(data), max_bytes, at_least=True)
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError as exc:
            return Rejection(
                Reject.NOT_UTF8, f"text is not valid Unicode: {exc.reason} at character {exc.start}"
            )
        if len(raw) > max_bytes:
            return _too_large(len(raw), max_bytes)
        text = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > max_bytes:
            return _too_large(size, max_bytes)
        try:
            raw = bytes(data)
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Rejection(
                Reject.NOT_UTF8,
                f"payload is not UTF-8: byte {exc.start} "
                f"({exc.reason}); the bus carries UTF-8 JSON only",
            )
    else:
        return Rejection(Reject.NOT_JSON, f"expected bytes or str, got {type(data).__name__}")

    # Whether the document may hold a value the console cannot store, and must be walked:
    # a NUL or surrogate escape, or an integer literal long enough to pass 64 bits. Almost no
    # message does. (A regex over the text for both cost more than parsing it.)
    suspect = "\\u" in text and _SUSPECT_ESCAPE.search(text) is not None
    doc = _parsed_fast(raw)
    if doc is _NOT_PARSED:
        try:
            try:
                doc = json.loads(text, parse_constant=_reject_constant,
                                 parse_float=_finite_float, parse_int=_short_int)
            except _LongInteger:
                doc = json.loads(text, parse_constant=_reject_constant,
                                 parse_float=_finite_float)
                suspect = True
        except RecursionError:
            return Rejection(Reject.NOT_JSON, "payload is JSON nested too deeply to read")
        except ValueError as exc:  # JSONDecodeError, our NaN/Infinity guards, digit limit
            return Rejection(Reject.NOT_JSON, f"payload is not JSON: {exc}")
    elif not suspect:
        suspect = _LONG_DIGITS in raw.translate(_DIGITS_ONLY)

    if not isinstance(doc, dict):
        return Rejection(
            Reject.NOT_OBJECT,
            f'top level is {_describe(doc)}, not an object {{"protocol", "version", "message"}}',
        )

    protocol = doc.get("protocol")
    if protocol is None and "header" in doc and "payload" in doc:
        # The reachability layer's own envelope: name the dialect, not a missing field.
        return Rejection(Reject.WRONG_PROTOCOL, _OTHER_DIALECT)
    if protocol != PROTOCOL:
        got = "missing" if "protocol" not in doc else _describe(protocol)
        return Rejection(Reject.WRONG_PROTOCOL, f'protocol is {got}; expected "{PROTOCOL}"')

    version = doc.get("version")
    if not isinstance(version, str):
        got = "missing" if "version" not in doc else _describe(version)
        return Rejection(
            Reject.BAD_VERSION, f'version is {got}; expected a string such as "{VERSION}"'
        )
    if not _version_is_supported(version):
        return Rejection(
            Reject.BAD_VERSION,
            f"version {version[:40]!r} is not supported; "
            f'this console reads major version {SUPPORTED_MAJOR} (e.g. "{VERSION}")',
        )

    message = doc.get("message")
    if not isinstance(message, dict):
        got = "missing" if "message" not in doc else _describe(message)
        return Rejection(Reject.NO_MESSAGE, f"message is {got}; expected an object")

    message_id = message.get("messageId")
    if not isinstance(message_id, str) or not message_id:
        got = "missing" if "messageId" not in message else _describe(message_id)
        return Rejection(
            Reject.MISSING_MESSAGE_ID, f"messageId is {got}; expected a non-empty string"
        )
    if len(message_id) > MAX_MESSAGE_ID_CHARS:
        return Rejection(
            Reject.BAD_FIELD,
            f"messageId is {len(message_id)} characters; the limit is {MAX_MESSAGE_ID_CHARS}",
        )

    raw_type = message.get("messageType")
    if raw_type is None:
        return Rejection(
            Reject.MISSING_MESSAGE_TYPE,
            f"message {message_id!r} has no messageType; expected one of {_TYPE_NAMES}",
        )
    message_type = _TYPES_BY_VALUE.get(raw_type) if isinstance(raw_type, str) else None
    if message_type is None:
        return Rejection(
            Reject.UNKNOWN_MESSAGE_TYPE,
            f"message {message_id!r} has messageType "
            f"{_describe(raw_type)}; expected one of {_TYPE_NAMES}",
        )

    result = _decode_fields(suspect, doc, message, message_id, message_type, version)
    if isinstance(result, Rejection):
        return replace(result, message_id=_answerable_id(message_id), message_type=message_type,
                       origin_node_id=_answerable_origin(message.get("headers")))
    return result


def _answerable_id(message_id: str) -> str | None:
    # An id the console cannot store could not be named in an answer's ackFor either.
    return None if unstorable(message_id, "messageId") else message_id


def _answerable_origin(headers: Any) -> str | None:
    origin = headers.get("originNodeId") if isinstance(headers, dict) else None
    try:
        return validate_node_id(origin)
    except ValueError:
        return None


def _decode_fields(suspect: bool, doc: dict, message: dict, message_id: str,
                   message_type: MessageType, version: str) -> Envelope | Rejection:
    fields: dict[str, Any] = {}
    for attr, wire in _OPTIONAL_STR_FIELDS:
        value = message.get(wire)
        if value is not None and not isinstance(value, str):
            return _bad_field(message_id, wire, value, "a string or null")
        fields[attr] = value

    timestamp = message.get("timestamp")
    if timestamp is not None and (not isinstance(timestamp, int) or isinstance(timestamp, bool)):
        return _bad_field(message_id, "timestamp", timestamp, "an integer of epoch milliseconds")

    headers = message.get("headers")
    if headers is None:
        headers = {}
    elif not isinstance(headers, dict):
        return _bad_field(message_id, "headers", headers, "an object or null")
    attempt = _positive_int(headers.get("attempt"))
    if attempt is not None and attempt > MAX_ATTEMPT:
        # Stored in an integer column: past it the row could not be written at all.
        return _bad_field(message_id, "headers.attempt", attempt,
                          f"a count of attempts up to {MAX_ATTEMPT}")

    # Node ids become MQTT topic levels (replies go to `P/node/{replyNodeId}/inbox`): one with
    # a wildcard or a '/' would answer to a wildcard or another topic.
    for wire, value in (("targetNodeId", fields["target_node_id"]),
                        ("headers.replyNodeId", headers.get("replyNodeId")),
                        ("headers.originNodeId", headers.get("originNodeId"))):
        if value:  # empty or absent: none given
            try:
                validate_node_id(value)
            except ValueError as exc:
                return Rejection(Reject.BAD_NODE_ID, f"message {message_id!r}: {wire}: {exc}")

    unstorable = _unstorable(doc) if suspect else None
    if unstorable is not None:
        return Rejection(unstorable[0], f"message {message_id!r}: {unstorable[1]}")

    return Envelope(
        message_id=message_id,
        message_type=message_type,
        timestamp=timestamp,
        headers=headers,
        payload=message.get("payload"),
        version=version,
        signature=doc.get("signature"),
        wire_message=message,
        **fields,
    )


# The escapes of a NUL or of a surrogate (a lone one cannot be stored; a pair is walked
# and passes).
_SUSPECT_ESCAPE = re.compile(r"\\u0000|\\u[dD][89a-fA-F]")


# The parse of (nearly) every message: msgspec's JSON decoder, in C, about six times faster
# than json.loads with the hooks below, and exact: it keeps integers of any size as Python
# ints (orjson turns those past 64 bits into floats). Whatever it refuses (malformed JSON,
# NaN or Infinity, a lone surrogate, a number out of a float's range, nesting too deep) is
# parsed again by the standard library below, so a refusal has the same words as before.
_FAST_DECODER = msgspec.json.Decoder()
_NOT_PARSED = object()
# An integer literal of 19 digits or more may pass 64 bits: such a document is walked. The
# bytes with every digit made "9" and everything else a space, then one substring search:
# a thirtieth of what a regex over the text costs.
_DIGITS_ONLY = bytes(0x39 if 0x30 <= code <= 0x39 else 0x20 for code in range(256))
_LONG_DIGITS = b"9" * 19


def _parsed_fast(raw: bytes) -> Any:
    # msgspec reads a little deeper nesting than json.loads does at the same stack depth:
    # a document that could be that deep is left to the standard library, which refuses it
    # as it always has ("nested too deeply"). Two counts in C, no walk.
    if raw.count(b"[") + raw.count(b"{") > _DEEP:
        return _NOT_PARSED
    try:
        return _FAST_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _NOT_PARSED


_DEEP = 256  # brackets in a document: fewer cannot nest deep enough to matter


class _LongInteger(Exception):
    """An integer literal of 19 characters or more: it may pass 64 bits."""


def _short_int(literal: str) -> int:
    if len(literal) >= 19:
        raise _LongInteger
    return int(literal)


def _unstorable(doc: Any) -> tuple[Reject, str] | None:
    """A value the console cannot store (reachconsole/core/jsonsafe.py): the message is
    rejected with where it is, instead of failing inside the handler."""
    bad = unstorable(doc, "envelope")
    if bad is None:
        return None
    code, where = bad
    return Reject(code), WORDS[code].format(where=where)


def _too_large(size: int, max_bytes: int, *, at_least: bool = False) -> Rejection:
    amount = f"at least {size}" if at_least else str(size)
    return Rejection(Reject.TOO_LARGE, f"payload is {amount} bytes; the limit is {max_bytes}")


def _bad_field(message_id: str, wire: str, value: Any, expected: str) -> Rejection:
    return Rejection(
        Reject.BAD_FIELD,
        f"message {message_id!r}: {wire} is {_describe(value)}; expected {expected}",
    )


def encode(envelope: Envelope, *, max_bytes: int = DEFAULT_MAX_BYTES,
           key: signing.NodeKey | None = None) -> bytes:
    """Compact UTF-8 JSON for the bus, signed with `key` when one is given.

    Raises PayloadTooLarge over ``max_bytes`` (never truncates), ValueError for an envelope
    that a receiver would reject or a payload holding NaN/Infinity, and TypeError for a
    payload that is not JSON-serialisable.
    """
    if not isinstance(envelope.message_id, str) or not envelope.message_id:
        raise ValueError("envelope has no messageId; receivers drop such messages")
    if len(envelope.message_id) > MAX_MESSAGE_ID_CHARS:
        raise ValueError(
            f"messageId is {len(envelope.message_id)} characters; the limit is "
            f"{MAX_MESSAGE_ID_CHARS}"
        )
    if envelope.message_type not in _TYPES_BY_VALUE:
        raise ValueError(f"messageType {envelope.message_type!r} is not one of {_TYPE_NAMES}")
    wire = envelope.to_wire()
    if key is not None:
        wire["signature"] = signing.signature_make(wire["message"], key)
    try:
        data = json.dumps(wire, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode(
            "utf-8"
        )
    except UnicodeEncodeError:
        # A lone surrogate (legal in a JSON "\ud800" escape, and so in what decode returns)
        # has no UTF-8 form; ASCII escapes carry it and decode back to the same string.
        data = json.dumps(wire, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode(
            "ascii"
        )
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"message {envelope.message_id} ({envelope.message_type}) encodes to {len(data)} "
            f"bytes; the limit is {max_bytes}. Send a smaller payload or a reference to it; "
            "the bus never truncates."
        )
    return data


def new_envelope(
    *,
    message_type: MessageType | str,
    from_agent_id: str | None = None,
    to_agent_id: str | None = None,
    target_node_id: str | None = None,
    task_id: str | None = None,
    headers: dict[str, Any] | None = None,
    payload: Any = None,
    conversation_id: str | None = None,
    scene_group_id: str | None = None,
    session_id: str | None = None,
    message_id: str | None = None,
) -> Envelope:
    """A fresh transmission: a new messageId (uuid4) unless given, stamped now in ms."""
    if message_id is None:
        message_id = str(uuid.uuid4())
    elif not isinstance(message_id, str) or not message_id:
        raise ValueError("message_id must be a non-empty string")
    elif len(message_id) > MAX_MESSAGE_ID_CHARS:
        raise ValueError(
            f"message_id is {len(message_id)} characters; the limit is {MAX_MESSAGE_ID_CHARS}"
        )
    return Envelope(
        message_id=message_id,
        message_type=MessageType(message_type),
        task_id=task_id,
        from_agent_id=from_agent_id,
        to_agent_id=to_agent_id,
        target_node_id=target_node_id,
        conversation_id=conversation_id,
        scene_group_id=scene_group_id,
        session_id=session_id,
        timestamp=time.time_ns() // 1_000_000,
        headers=dict(headers) if headers else {},
        payload=payload,
    )


# --- topics -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopicMatch:
    kind: Literal["inbox", "heartbeat"]
    node_id: str


def _bad_topic_char(text: str) -> str | None:
    # On every node id of every message: the whole text at once first (every character
    # `isspace` takes but the plain space is also one `isprintable` refuses).
    if text.isprintable() and " " not in text and "+" not in text and "#" not in text:
        return None
    for ch in text:
        if ch in "+#":
            return f"MQTT wildcard {ch!r}"
        # isprintable is False for control, format and separator characters; isspace
        # catches the plain space that isprintable lets through.
        if ch.isspace() or not ch.isprintable():
            return f"whitespace or control character U+{ord(ch):04X}"
    return None


def validate_node_id(node_id: Any) -> str:
    """Return ``node_id`` if it can stand as one MQTT topic level, else raise ValueError.

    A '+' or '#' would turn a targeted topic into a wildcard, and a '/' would move the
    message to another topic: both would break "no broadcast fallback".
    """
    if not isinstance(node_id, str):
        # ValueError, not TypeError: callers catch one error for "not a usable node id".
        raise ValueError(f"node id must be a string, not {type(node_id).__name__}")  # noqa: TRY004
    if not node_id:
        raise ValueError("node id is empty; a node without an id stays out of targeted delivery")
    if len(node_id) > MAX_NODE_ID_CHARS:
        raise ValueError(f"node id is {len(node_id)} characters; the limit is {MAX_NODE_ID_CHARS}")
    if "/" in node_id:
        raise ValueError(f"node id {node_id!r} contains '/', which would split the topic level")
    bad = _bad_topic_char(node_id)
    if bad:
        raise ValueError(f"node id {node_id!r} contains a {bad}")
    return node_id


def _validate_prefix(prefix: Any) -> str:
    # The prefix may span levels ("org/ooder") but must not be a wildcard itself, or the
    # console would subscribe to, or publish on, other applications' topics.
    if not isinstance(prefix, str) or not prefix:
        raise ValueError("topic prefix (MQTT_TOPIC_PREFIX) must be a non-empty string")
    if prefix.endswith("/"):
        raise ValueError(f"topic prefix {prefix!r} must not end with '/'")
    bad = _bad_topic_char(prefix)
    if bad:
        raise ValueError(f"topic prefix {prefix!r} contains a {bad}")
    return prefix


def inbox_topic(prefix: str, node_id: str) -> str:
    return f"{_validate_prefix(prefix)}/node/{validate_node_id(node_id)}/inbox"


def profile_request_topic(root: str, agent_id: str) -> str:
    """Where an A2A-over-MQTT agent (or pool) of the profile's root takes its requests."""
    return f"{root}/request/{agent_id}"


def heartbeat_topic(prefix: str, node_id: str) -> str:
    return f"{_validate_prefix(prefix)}/heartbeat/{validate_node_id(node_id)}"


def probe_topic(prefix: str, client_id: str) -> str:
    """Where one bridge of the console sends its probe, and takes it back: the proof that it
    hears the bus (roster/hearing.py). Nobody else subscribes; no wildcard of ours covers it."""
    level = "".join("_" if ch in "+#/" or not ch.isprintable() else ch for ch in client_id)
    return f"{_validate_prefix(prefix)}/console/{level or '_'}/probe"


def inbox_wildcard(prefix: str) -> str:
    """Monitor mode only: a consumer never subscribes to every inbox."""
    return f"{_validate_prefix(prefix)}/node/+/inbox"


def heartbeat_wildcard(prefix: str) -> str:
    return f"{_validate_prefix(prefix)}/heartbeat/+"


def inbox_node_of(topic: str) -> str:
    """The node whose inbox `topic` is (`…/node/{nodeId}/inbox`), or "" for another topic.
    For a topic already taken apart by parse_topic, when its prefix is not at hand."""
    levels = topic.split("/")
    if len(levels) >= 4 and levels[-1] == "inbox" and levels[-3] == "node":
        return levels[-2]
    return ""


def parse_topic(prefix: str, topic: str) -> TopicMatch | None:
    """Which node a received topic is about, or None for any topic not ours."""
    if not isinstance(prefix, str) or not isinstance(topic, str) or not prefix:
        return None
    head = prefix + "/"
    if not topic.startswith(head):
        return None
    levels = topic[len(head) :].split("/")
    if len(levels) == 3 and levels[0] == "node" and levels[2] == "inbox":
        kind: Literal["inbox", "heartbeat"] = "inbox"
    elif len(levels) == 2 and levels[0] == "heartbeat":
        kind = "heartbeat"
    else:
        return None
    try:
        node_id = validate_node_id(levels[1])
    except ValueError:
        return None
    return TopicMatch(kind=kind, node_id=node_id)
