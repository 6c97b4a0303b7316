"""The A2A envelope codec and topic names against shared/PROTOCOL.md. No database needed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.protocol import (
    PROTOCOL,
    SUPPORTED_MAJOR,
    VERSION,
    Envelope,
    MessageType,
    PayloadTooLarge,
    Reject,
    Rejection,
    TopicMatch,
    decode,
    encode,
    heartbeat_topic,
    heartbeat_wildcard,
    inbox_topic,
    inbox_wildcard,
    new_envelope,
    parse_topic,
    validate_node_id,
)

# Copied verbatim from shared/PROTOCOL.md, section "Envelope".
PROTOCOL_EXAMPLE = """
{
  "protocol": "a2a",
  "version": "1.0",
  "message": {
    "messageId": "f47ac10b-58cc-4372-a567-0e02b2c3d479",
    "taskId": "task-20261129-8891",
    "messageType": "TASK_REQUEST",
    "fromAgentId": "orchestrator.main",
    "toAgentId": "project-x.research-agent",
    "targetNodeId": "node-b",
    "conversationId": "conv-42",
    "sceneGroupId": null,
    "sessionId": null,
    "timestamp": 1764417600000,
    "headers": {
      "replyNodeId": "console",
      "originNodeId": "console",
      "idempotencyKey": "task-20261129-8891",
      "timeoutMs": 30000,
      "attempt": 1
    },
    "payload": {"input": {"query": "..."}}
  }
}
"""

# Copied verbatim from shared/PROTOCOL.md, section "Heartbeat". The backslash only folds the
# long last line to fit the line limit; the string's text is the document's.
HEARTBEAT_EXAMPLE = """
{"protocol": "a2a", "version": "1.0", "message": {
  "messageId": "…", "messageType": "HEARTBEAT", "fromAgentId": "node-b",
  "headers": {"originNodeId": "node-b"},
  "payload": {"heartbeatMs": 5000,
              "agents": [{"agentId": "fin.tax", "inflight": 2, "queueDepth": 0, \
"maxInflight": 8}]}}}
"""


def wire(message: Any = None, **top: Any) -> bytes:
    """A raw message with sane defaults, for poking at one rule at a time."""
    doc: dict[str, Any] = {"protocol": "a2a", "version": "1.0"}
    doc["message"] = {"messageId": "m-1", "messageType": "EVENT"} if message is None else message
    doc.update(top)
    return json.dumps(doc).encode()


def rejected(result: Envelope | Rejection, reason: Reject) -> Rejection:
    assert isinstance(result, Rejection), result
    assert result.reason is reason, result
    # Words a person can act on, not a bare code.
    assert len(result.detail.split()) >= 3, result.detail
    return result


# --- round trips ----------------------------------------------------------------------------


def test_it_round_trips_a_new_envelope_with_every_field() -> None:
    env = new_envelope(
        message_type=MessageType.TASK_REQUEST,
        from_agent_id="orchestrator.main",
        to_agent_id="fin.tax",
        target_node_id="node-b",
        task_id="task-1",
        headers={"replyNodeId": "console", "idempotencyKey": "task-1", "attempt": 2},
        payload={"input": {"query": "@资金日报", "n": [1, 2.5, None, True, {"深": ["度"]}]}},
        conversation_id="conv-42",
        scene_group_id="sg-1",
        session_id="sess-1",
    )
    back = decode(encode(env))
    assert back == env
    assert isinstance(back, Envelope)
    assert back.payload["input"]["query"] == "@资金日报"
    assert back.message_type is MessageType.TASK_REQUEST


def test_it_encodes_compact_utf8_without_ascii_escapes() -> None:
    env = new_envelope(message_type="EVENT", payload={"q": "@资金日报"})
    data = encode(env)
    assert "@资金日报".encode() in data
    assert b", " not in data and b": " not in data


def test_it_writes_every_wire_field_in_camel_case() -> None:
    env = new_envelope(message_type=MessageType.ACK, headers={"ackFor": "m-0"})
    doc = env.to_wire()
    assert doc["protocol"] == PROTOCOL and doc["version"] == VERSION
    msg = doc["message"]
    assert msg["messageId"] == env.message_id and msg["messageType"] == "ACK"
    assert msg["headers"] == {"ackFor": "m-0"} and msg["payload"] is None
    assert set(msg) >= {"messageId", "messageType", "headers", "payload", "timestamp"}
    assert all("_" not in key for key in msg)


def test_it_gives_each_new_envelope_its_own_id_and_a_timestamp_in_ms() -> None:
    a = new_envelope(message_type=MessageType.EVENT)
    b = new_envelope(message_type=MessageType.EVENT)
    assert a.message_id != b.message_id
    assert a.timestamp is not None and a.timestamp > 1_700_000_000_000


def test_it_refuses_to_build_an_envelope_with_an_unknown_type_or_empty_id() -> None:
    with pytest.raises(ValueError):
        new_envelope(message_type="PING")
    with pytest.raises(ValueError):
        new_envelope(message_type="EVENT", message_id="")
    with pytest.raises(ValueError):
        new_envelope(message_type="EVENT", message_id="x" * 201)


# --- the examples in PROTOCOL.md --------------------------------------------------------------


def test_it_decodes_the_protocol_example_envelope() -> None:
    env = decode(PROTOCOL_EXAMPLE.encode())
    assert isinstance(env, Envelope)
    assert env.message_id == "f47ac10b-58cc-4372-a567-0e02b2c3d479"
    assert env.message_type is MessageType.TASK_REQUEST
    assert env.task_id == "task-20261129-8891"
    assert env.from_agent_id == "orchestrator.main"
    assert env.to_agent_id == "project-x.research-agent"
    assert env.target_node_id == "node-b"
    assert env.conversation_id == "conv-42"
    assert env.scene_group_id is None and env.session_id is None
    assert env.timestamp == 1764417600000
    assert env.reply_node_id == "console"
    assert env.origin_node_id == "console"
    assert env.idempotency_key == "task-20261129-8891"
    assert env.timeout_ms == 30000
    assert env.attempt == 1
    assert env.payload == {"input": {"query": "..."}}
    assert env.version == "1.0"


def test_it_decodes_the_protocol_heartbeat_example() -> None:
    env = decode(HEARTBEAT_EXAMPLE)
    assert isinstance(env, Envelope)
    assert env.message_id == "…"
    assert env.message_type is MessageType.HEARTBEAT
    assert env.from_agent_id == "node-b"
    assert env.origin_node_id == "node-b"
    assert env.timestamp is None and env.task_id is None
    assert env.payload["heartbeatMs"] == 5000
    assert env.payload["agents"] == [
        {"agentId": "fin.tax", "inflight": 2, "queueDepth": 0, "maxInflight": 8}
    ]


# --- each rejection reason --------------------------------------------------------------------


def test_it_rejects_a_payload_over_the_limit_before_parsing() -> None:
    # Not even JSON: the size check must come first.
    result = rejected(decode(b"x" * 300001), Reject.TOO_LARGE)
    assert result.detail == "payload is 300001 bytes; the limit is 262144"


def test_it_counts_the_limit_in_utf8_bytes_not_characters() -> None:
    env = new_envelope(message_type="EVENT", message_id="m", payload="资" * 100)
    data = encode(env)
    assert isinstance(decode(data.decode(), max_bytes=len(data)), Envelope)
    rejected(decode(data.decode(), max_bytes=len(data) - 1), Reject.TOO_LARGE)
    rejected(decode(data, max_bytes=len(data) - 1), Reject.TOO_LARGE)


def test_it_rejects_bytes_that_are_not_utf8() -> None:
    rejected(decode(b'{"protocol": "a2a", "x": "\xff\xfe"}'), Reject.NOT_UTF8)


def test_it_rejects_text_that_is_not_json() -> None:
    rejected(decode(b"{not json"), Reject.NOT_JSON)
    rejected(decode(b""), Reject.NOT_JSON)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_it_rejects_non_finite_numbers(constant: str) -> None:
    raw = (
        '{"protocol": "a2a", "version": "1.0", "message": '
        f'{{"messageId": "m-1", "messageType": "EVENT", "payload": [{constant}]}}}}'
    )
    assert isinstance(json.loads(raw), dict)  # Python's json would take it; we must not
    rejected(decode(raw), Reject.NOT_JSON)


def test_it_rejects_json_nested_deeper_than_the_parser_can_go() -> None:
    rejected(decode(b"[" * 100_000), Reject.NOT_JSON)
    deep = '{"protocol":"a2a","version":"1.0","message":' + "[" * 50_000 + "]" * 50_000 + "}"
    rejected(decode(deep), Reject.NOT_JSON)


def test_it_rejects_a_top_level_that_is_not_an_object() -> None:
    rejected(decode(b"[1, 2]"), Reject.NOT_OBJECT)
    rejected(decode(b'"a2a"'), Reject.NOT_OBJECT)
    rejected(decode(b"null"), Reject.NOT_OBJECT)


def test_it_rejects_another_protocol() -> None:
    rejected(decode(wire(protocol="mcp")), Reject.WRONG_PROTOCOL)
    rejected(decode(b'{"version": "1.0", "message": {}}'), Reject.WRONG_PROTOCOL)


def test_an_agent_reach_envelope_is_named_as_the_other_dialect_with_the_right_shape() -> None:
    theirs = {"header": {"msg_id": "m-1", "from": "fin.tax", "to": "hr.pay"},
              "payload": {"text": "hello"}}
    refusal = rejected(decode(json.dumps(theirs)), Reject.WRONG_PROTOCOL)
    assert "Agent-Reach" in refusal.detail
    assert '{"protocol": "a2a", "version": "1.0", "message": {"messageId"' in refusal.detail
    # Anything else without a protocol is still just that.
    plain = rejected(decode(b'{"payload": {}}'), Reject.WRONG_PROTOCOL)
    assert "Agent-Reach" not in plain.detail and "protocol is missing" in plain.detail


@pytest.mark.parametrize("version", ["2.0", "abc", "0.9", "", "1.x", "١.0", None, 1.0, 1, [1]])
def test_it_rejects_an_unsupported_or_malformed_version(version: Any) -> None:
    rejected(decode(wire(version=version)), Reject.BAD_VERSION)


def test_it_rejects_a_missing_version() -> None:
    rejected(decode(b'{"protocol": "a2a", "message": {}}'), Reject.BAD_VERSION)


@pytest.mark.parametrize("version", ["1", "1.0", "1.7", "1.10.3"])
def test_it_accepts_any_minor_of_the_supported_major(version: str) -> None:
    env = decode(wire(version=version))
    assert isinstance(env, Envelope)
    assert env.version == version
    assert int(version.split(".")[0]) == SUPPORTED_MAJOR


def test_it_rejects_a_missing_or_non_object_message() -> None:
    rejected(decode(b'{"protocol": "a2a", "version": "1.0"}'), Reject.NO_MESSAGE)
    rejected(decode(wire(message="hello")), Reject.NO_MESSAGE)
    rejected(decode(wire(message=[])), Reject.NO_MESSAGE)


@pytest.mark.parametrize("message_id", [None, "", 42, ["m"]])
def test_it_rejects_a_missing_or_empty_message_id(message_id: Any) -> None:
    msg: dict[str, Any] = {"messageType": "EVENT"}
    if message_id is not None:
        msg["messageId"] = message_id
    rejected(decode(wire(msg)), Reject.MISSING_MESSAGE_ID)


def test_it_rejects_a_message_id_over_200_characters() -> None:
    assert isinstance(decode(wire({"messageId": "m" * 200, "messageType": "ACK"})), Envelope)
    rejected(decode(wire({"messageId": "m" * 201, "messageType": "ACK"})), Reject.BAD_FIELD)


def test_it_rejects_a_missing_message_type() -> None:
    rejected(decode(wire({"messageId": "m-1"})), Reject.MISSING_MESSAGE_TYPE)
    rejected(decode(wire({"messageId": "m-1", "messageType": None})), Reject.MISSING_MESSAGE_TYPE)


@pytest.mark.parametrize("message_type", ["PING", "task_request", "", 3, {"t": "ACK"}])
def test_it_rejects_an_unknown_message_type(message_type: Any) -> None:
    result = rejected(
        decode(wire({"messageId": "m-1", "messageType": message_type})), Reject.UNKNOWN_MESSAGE_TYPE
    )
    assert "TASK_REQUEST" in result.detail


@pytest.mark.parametrize(
    "field_name,value",
    [
        ("taskId", 7),
        ("fromAgentId", ["a"]),
        ("toAgentId", {"x": 1}),
        ("targetNodeId", True),
        ("conversationId", 1.5),
        ("sceneGroupId", 0),
        ("sessionId", False),
        ("timestamp", "1764417600000"),
        ("timestamp", 1764417600000.5),
        ("timestamp", True),
        ("headers", "replyNodeId=console"),
        ("headers", [1]),
    ],
)
def test_it_rejects_a_field_of_the_wrong_type(field_name: str, value: Any) -> None:
    msg = {"messageId": "m-1", "messageType": "EVENT", field_name: value}
    result = rejected(decode(wire(msg)), Reject.BAD_FIELD)
    assert field_name in result.detail and "m-1" in result.detail


def test_it_rejects_an_attempt_count_beyond_what_can_be_stored() -> None:
    msg = {"messageId": "m-1", "messageType": "EVENT", "headers": {"attempt": 2**31}}
    result = rejected(decode(wire(msg)), Reject.BAD_FIELD)
    assert "headers.attempt" in result.detail and "2147483647" in result.detail
    msg["headers"]["attempt"] = 2**31 - 1
    assert decode(wire(msg)).attempt == 2**31 - 1


def test_it_accepts_null_optional_fields_and_ignores_unknown_ones() -> None:
    msg = {
        "messageId": "m-1",
        "messageType": "DRAIN",
        "taskId": None,
        "headers": None,
        "timestamp": None,
        "somethingNew": {"x": 1},
    }
    env = decode(wire(msg, extra="ignored"))
    assert env == Envelope(message_id="m-1", message_type=MessageType.DRAIN)


def test_it_covers_every_reject_reason_in_these_tests() -> None:
    # A new reason added to the enum must come with a test of its own.
    assert {r.name for r in Reject} == {
        "NUL_CHARACTER",
        "LONE_SURROGATE",
        "NUMBER_OUT_OF_RANGE",
        "BAD_NODE_ID",
        "TOO_LARGE",
        "NOT_UTF8",
        "NOT_JSON",
        "NOT_OBJECT",
        "WRONG_PROTOCOL",
        "BAD_VERSION",
        "NO_MESSAGE",
        "MISSING_MESSAGE_ID",
        "MISSING_MESSAGE_TYPE",
        "UNKNOWN_MESSAGE_TYPE",
        "BAD_FIELD",
    }
    assert all(r.value == r.value.lower() and " " not in r.value for r in Reject)


def test_it_rejects_inputs_that_are_not_bytes_or_text_without_raising() -> None:
    for junk in (None, 42, object(), ["{}"]):
        assert isinstance(decode(junk), Rejection)  # type: ignore[arg-type]
    assert isinstance(decode(bytearray(wire())), Envelope)
    assert isinstance(decode(memoryview(wire())), Envelope)


# --- size on the way out ----------------------------------------------------------------------


def test_it_refuses_to_encode_over_the_limit_and_never_truncates() -> None:
    env = new_envelope(message_type="TASK_REQUEST", payload="x" * 300_000)
    with pytest.raises(PayloadTooLarge) as info:
        encode(env)
    assert "262144" in str(info.value) and env.message_id in str(info.value)
    assert isinstance(info.value, ValueError)
    small = new_envelope(message_type="EVENT", payload="x" * 100)
    data = encode(small)
    assert encode(small, max_bytes=len(data)) == data
    with pytest.raises(PayloadTooLarge):
        encode(small, max_bytes=len(data) - 1)


def test_it_refuses_to_encode_what_a_receiver_would_drop() -> None:
    with pytest.raises(ValueError):
        encode(Envelope(message_id="", message_type=MessageType.ACK))
    with pytest.raises(ValueError):
        encode(new_envelope(message_type="EVENT", payload=float("nan")))


# --- header conveniences ----------------------------------------------------------------------


def test_it_falls_back_to_the_message_id_as_idempotency_key() -> None:
    env = Envelope(message_id="m-9", message_type=MessageType.TASK_REQUEST)
    assert env.idempotency_key == "m-9"
    for bad in ("", 5, None):
        assert (
            Envelope(
                message_id="m-9", message_type=MessageType.ACK, headers={"idempotencyKey": bad}
            ).idempotency_key
            == "m-9"
        )
    keyed = Envelope(
        message_id="m-9", message_type=MessageType.ACK, headers={"idempotencyKey": "task-1"}
    )
    assert keyed.idempotency_key == "task-1"


def test_it_defaults_attempt_to_one_and_ignores_headers_of_the_wrong_type() -> None:
    env = Envelope(message_id="m", message_type=MessageType.EVENT)
    assert env.attempt == 1
    assert env.timeout_ms is None
    assert env.reply_node_id is None and env.origin_node_id is None
    assert env.ack_for is None and env.in_reply_to is None
    odd = Envelope(
        message_id="m",
        message_type=MessageType.EVENT,
        headers={"attempt": "3", "timeoutMs": True, "replyNodeId": 4, "ackFor": []},
    )
    assert odd.attempt == 1 and odd.timeout_ms is None
    assert odd.reply_node_id is None and odd.ack_for is None
    good = Envelope(
        message_id="m",
        message_type=MessageType.TASK_RESPONSE,
        headers={"attempt": 3, "timeoutMs": 500, "ackFor": "a", "inReplyTo": "r"},
    )
    assert good.attempt == 3 and good.timeout_ms == 500
    assert good.ack_for == "a" and good.in_reply_to == "r"


# --- topics -----------------------------------------------------------------------------------


def test_it_builds_and_parses_topics() -> None:
    assert inbox_topic("ooder", "node-b") == "ooder/node/node-b/inbox"
    assert heartbeat_topic("ooder", "node-b") == "ooder/heartbeat/node-b"
    assert inbox_wildcard("ooder") == "ooder/node/+/inbox"
    assert heartbeat_wildcard("ooder") == "ooder/heartbeat/+"
    for prefix in ("ooder", "org/ooder"):
        assert parse_topic(prefix, inbox_topic(prefix, "node-b")) == TopicMatch("inbox", "node-b")
        assert parse_topic(prefix, heartbeat_topic(prefix, "资金")) == TopicMatch(
            "heartbeat", "资金"
        )


@pytest.mark.parametrize(
    "topic",
    [
        "other/node/node-b/inbox",
        "ooderx/node/node-b/inbox",
        "ooder/node/node-b",
        "ooder/node/node-b/outbox",
        "ooder/node//inbox",
        "ooder/node/+/inbox",
        "ooder/node/a/b/inbox",
        "ooder/heartbeat/",
        "ooder/heartbeat/#",
        "ooder/heartbeat/node-b/extra",
        "ooder",
        "",
    ],
)
def test_it_parses_foreign_or_malformed_topics_as_none(topic: str) -> None:
    assert parse_topic("ooder", topic) is None


@pytest.mark.parametrize(
    "node_id", ["+", "#", "a/b", "", "a b", "tab\t", "nul\x00", "x" * 129, None, 7]
)
def test_it_rejects_node_ids_that_are_not_one_topic_level(node_id: Any) -> None:
    with pytest.raises(ValueError) as info:
        validate_node_id(node_id)
    assert len(str(info.value).split()) >= 3
    with pytest.raises(ValueError):
        inbox_topic("ooder", node_id)


def test_it_accepts_ordinary_node_ids() -> None:
    assert validate_node_id("node-b") == "node-b"
    assert validate_node_id("x" * 128) == "x" * 128
    assert validate_node_id("console") == "console"


@pytest.mark.parametrize("prefix", ["", "ooder/", "oo+der", "#", "a b"])
def test_it_rejects_a_prefix_that_would_widen_the_subscription(prefix: str) -> None:
    with pytest.raises(ValueError):
        inbox_wildcard(prefix)


# --- properties -------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=25,
)
finite_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=25,
)
type_names = st.sampled_from([t.value for t in MessageType])


def _either(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # Mostly well-formed, so that generated messages get past the early rules and exercise
    # the later ones (and the re-encode check) instead of all stopping at "protocol".
    return st.sampled_from([True, True, True, False]).flatmap(
        lambda ok: good if ok else json_values
    )


optional_str = st.none() | st.text(max_size=30)
envelope_shaped = st.fixed_dictionaries(
    {
        "protocol": _either(st.just("a2a")),
        "version": _either(st.sampled_from(["1", "1.0", "1.7", "2.0", "abc"])),
        "message": _either(
            st.fixed_dictionaries(
                {
                    "messageId": _either(st.text(min_size=1, max_size=210)),
                    "messageType": _either(type_names),
                },
                optional={
                    "taskId": _either(optional_str),
                    "fromAgentId": _either(optional_str),
                    "toAgentId": _either(optional_str),
                    "targetNodeId": _either(optional_str),
                    "conversationId": _either(optional_str),
                    "sceneGroupId": _either(optional_str),
                    "sessionId": _either(optional_str),
                    "timestamp": _either(st.integers() | st.none()),
                    "headers": _either(st.dictionaries(st.text(max_size=12), json_values)),
                    "payload": json_values,
                },
            )
        ),
    },
    optional={"extra": json_values},
)

# What the console accepts: text without NUL or lone surrogates, integers within 64 bits,
# node ids that stand as one topic level.
storable_text = st.text(alphabet=st.characters(blacklist_characters="\x00",
                                               blacklist_categories=("Cs",)))
storable_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | storable_text,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(storable_text.filter(lambda k: len(k) <= 10), children, max_size=5)
    ),
    max_leaves=25,
)
optional_storable = st.none() | storable_text.filter(lambda t: len(t) <= 30)
node_ids = st.none() | st.just("") | st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.:-]{0,40}\Z")

valid_envelopes = st.builds(
    Envelope,
    message_id=storable_text.filter(lambda t: 1 <= len(t) <= 200),
    message_type=st.sampled_from(MessageType),
    task_id=optional_storable,
    from_agent_id=optional_storable,
    to_agent_id=optional_storable,
    target_node_id=node_ids,
    conversation_id=optional_storable,
    scene_group_id=optional_storable,
    session_id=optional_storable,
    timestamp=st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1),
    headers=st.dictionaries(
        # The validated headers are left out: node ids and the attempt count have limits.
        storable_text.filter(lambda k: len(k) <= 12
                             and k not in ("replyNodeId", "originNodeId", "attempt")),
        storable_json_values, max_size=6),
    payload=storable_json_values,
    version=st.sampled_from(["1", "1.0", "1.7", "1.10.3"]),
)


@settings(max_examples=300, deadline=None)
@given(st.binary())
def test_it_never_raises_on_arbitrary_bytes(data: bytes) -> None:
    assert isinstance(decode(data), (Envelope, Rejection))


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_it_never_raises_on_arbitrary_json(value: Any) -> None:
    assert isinstance(decode(json.dumps(value)), (Envelope, Rejection))
    raw = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    assert isinstance(decode(raw), (Envelope, Rejection))


@settings(max_examples=300, deadline=None)
@given(envelope_shaped)
def test_it_never_raises_on_envelope_shaped_json_and_re_encodes_what_it_accepts(
    doc: dict[str, Any],
) -> None:
    result = decode(json.dumps(doc))
    assert isinstance(result, (Envelope, Rejection))
    if isinstance(result, Envelope):
        assert decode(encode(result, max_bytes=10**9), max_bytes=10**9) == result
    else:
        assert result.detail


@settings(max_examples=300, deadline=None)
@given(valid_envelopes)
def test_it_round_trips_any_valid_envelope(env: Envelope) -> None:
    assert decode(encode(env, max_bytes=10**9), max_bytes=10**9) == env


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_it_never_raises_on_a_corrupted_valid_message(data: st.DataObject) -> None:
    raw = bytearray(encode(data.draw(valid_envelopes), max_bytes=10**9))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        raw[at] = data.draw(st.integers(min_value=0, max_value=255))
    assert isinstance(decode(bytes(raw), max_bytes=10**9), (Envelope, Rejection))


# --- values the console cannot store, and node ids that would change a topic -------------
_HOSTILE = {
    "nul": ('{"protocol":"a2a","version":"1.0","message":{"messageId":"m1",'
            '"messageType":"TASK_REQUEST","payload":{"t":"a\\u0000b"}}}',
            "nul_character", "envelope.message.payload.t contains a NUL character"),
    "surrogate": ('{"protocol":"a2a","version":"1.0","message":{"messageId":"m1",'
                  '"messageType":"TASK_REQUEST","payload":"\\ud800"}}',
                  "lone_surrogate", "envelope.message.payload contains a lone surrogate"),
    "wildcard reply node": ('{"protocol":"a2a","version":"1.0","message":{"messageId":"m1",'
                            '"messageType":"TASK_REQUEST","headers":{"replyNodeId":"+/#"}}}',
                            "bad_node_id", "headers.replyNodeId: node id '+/#'"),
    "path reply node": ('{"protocol":"a2a","version":"1.0","message":{"messageId":"m1",'
                        '"messageType":"TASK_REQUEST",'
                        '"headers":{"replyNodeId":"../../heartbeat/console"}}}',
                        "bad_node_id", "headers.replyNodeId: node id '../../heartbeat"),
    "huge number": ('{"protocol":"a2a","version":"1.0","message":{"messageId":"m1",'
                    '"messageType":"HEARTBEAT","payload":{"agents":[{"agentId":"a.b",'
                    '"inflight":1000000000000000000000000000000}]}}}',
                    "number_out_of_range", "payload.agents[0].inflight is a number beyond"),
}


@pytest.mark.parametrize("name", list(_HOSTILE))
def test_values_the_console_cannot_store_are_rejected_with_where(name):
    raw, reason, words = _HOSTILE[name]
    result = decode(raw.encode())
    assert isinstance(result, Rejection)
    assert result.reason == reason
    assert words in result.detail


@pytest.mark.parametrize(("literal", "kept"), [
    ("9223372036854775807", True), ("-9223372036854775808", True),
    ("9223372036854775808", False), ("-9223372036854775809", False),
    # Past 64 bits unsigned: a decoder that turned it into a float would store a rounded
    # number instead of refusing it.
    ("18446744073709551616", False), ("1" + "0" * 40, False),
    ("1234567890123456789", True), ("0.1234567890123456789", True),
])
def test_integers_are_read_exactly_and_refused_past_64_bits(literal: str, kept: bool):
    raw = ('{"protocol":"a2a","version":"1.0","message":{"messageId":"m1",'
           f'"messageType":"EVENT","payload":{{"n":{literal},"id":"12345678901234567890123"}}}}}}')
    result = decode(raw.encode())
    if kept:
        assert isinstance(result, Envelope)
        assert result.payload == {"n": json.loads(literal), "id": "12345678901234567890123"}
        assert type(result.payload["n"]) is type(json.loads(literal))
    else:
        assert isinstance(result, Rejection) and result.reason == Reject.NUMBER_OUT_OF_RANGE
        assert "payload.n is a number beyond 64 bits" in result.detail


def test_a_surrogate_pair_is_text_not_a_rejection():
    raw = ('{"protocol":"a2a","version":"1.0","message":{"messageId":"m1",'
           '"messageType":"EVENT","payload":"\\ud83d\\ude00"}}')
    assert decode(raw.encode()).payload == "\U0001F600"


# --- node ids: the three fields that become topic levels ----------------------------------------

NODE_FIELDS = ("targetNodeId", "headers.replyNodeId", "headers.originNodeId")
valid_node_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
# What would turn a topic level into a wildcard or another topic, or cannot be stored.
_node_poison = st.sampled_from(["+", "#", "/", "\x00", "\ud800", "\udfff", " ", "\t", "\n"])
bad_node_ids = st.one_of(
    st.builds(lambda head, bad, tail: head + bad + tail,
              st.text(alphabet="abc-.:_0123", max_size=10), _node_poison,
              st.text(alphabet="abc-.:_0123", max_size=10)),
    st.from_regex(r"\A[a-z]{129,140}\Z"),
)


def _with_node_ids(**ids: str) -> bytes:
    message: dict[str, Any] = {"messageId": "m-1", "messageType": "TASK_REQUEST",
                               "targetNodeId": ids.get("targetNodeId", "node-t"),
                               "headers": {"replyNodeId": ids.get("headers.replyNodeId", "node-r"),
                                           "originNodeId": ids.get("headers.originNodeId",
                                                                   "node-o")},
                               "payload": {"q": 1}}
    # ensure_ascii: a lone surrogate travels as the \ud800 escape a hostile sender would use.
    return json.dumps({"protocol": "a2a", "version": "1.0", "message": message},
                      ensure_ascii=True).encode()


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(NODE_FIELDS), bad_node_ids)
def test_a_bad_node_id_in_any_node_field_is_always_rejected(field_name: str, node_id: str):
    result = decode(_with_node_ids(**{field_name: node_id}))
    assert isinstance(result, Rejection)
    assert result.reason == Reject.BAD_NODE_ID and field_name in result.detail
    assert result.message_id == "m-1" and result.message_type == MessageType.TASK_REQUEST
    # A refusal is answered only to a valid origin: never to a topic built from this one.
    assert result.origin_node_id == (None if field_name == "headers.originNodeId" else "node-o")


@settings(max_examples=300, deadline=None)
@given(valid_node_ids, valid_node_ids, valid_node_ids)
def test_valid_node_ids_are_always_accepted(target: str, reply: str, origin: str):
    raw = _with_node_ids(**{"targetNodeId": target, "headers.replyNodeId": reply,
                            "headers.originNodeId": origin})
    env = decode(raw)
    assert isinstance(env, Envelope)
    assert (env.target_node_id, env.reply_node_id, env.origin_node_id) == (target, reply, origin)
    for node_id in (target, reply, origin):
        assert inbox_topic("ooder", node_id) == f"ooder/node/{node_id}/inbox"
    # Rejected for something else, the message still names its origin, to be answered.
    poisoned = raw.replace(b'{"q": 1}', b'{"q": "a\\u0000b"}')
    rejection = decode(poisoned)
    assert isinstance(rejection, Rejection) and rejection.reason == Reject.NUL_CHARACTER
    assert rejection.origin_node_id == origin
