"""The load generator of bench/ingest.py: one paho-mqtt 2.x client in its own process.

It publishes N valid A2A envelopes at QoS 1 onto `<prefix>/node/<node>/inbox`, either as
fast as the broker takes them or at a fixed rate, and prints one JSON line of what it did.
"As fast as the broker takes them" means a window of in-flight publishes released by
PUBACKs: paho would otherwise queue without bound in memory, and the publish time written
into each payload would be the time it was queued, not the time it went on the wire.

Usage: python bench/publisher.py --prefix P --run R --messages N [--rate R] [--window 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NODES = 8  # inboxes of other nodes that the console watches in monitor mode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--prefix", required=True, help="MQTT topic prefix of this run")
    ap.add_argument("--run", required=True, help="run tag: message ids start with it")
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=0.0, help="msg/s; 0 = as fast as possible")
    ap.add_argument("--window", type=int, default=20,
                    help="QoS 1 publishes in flight (paho's default: 20)")
    ap.add_argument("--conversations", type=int, default=100,
                    help="distinct conversation ids (each is an event group in the console)")
    return ap.parse_args(argv)


class Publisher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.window = threading.Semaphore(args.window)
        self.connected = threading.Event()
        self.acked = 0
        self.errors: Counter = Counter()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=f"{args.run}-pub", protocol=mqtt.MQTTv5)
        self.client.max_inflight_messages_set(args.window)
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        from messages import protocol  # needs the project on sys.path (above)

        self.protocol = protocol

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if not reason_code.is_failure:
            self.connected.set()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        if getattr(reason_code, "is_failure", False):
            self.errors[f"puback:{reason_code}"] += 1
        self.acked += 1
        self.window.release()

    def connect(self) -> None:
        self.client.connect(self.args.host, self.args.port, keepalive=30)
        self.client.loop_start()
        if not self.connected.wait(10):
            raise SystemExit(f"publisher: no CONNACK from {self.args.host}:{self.args.port}")

    def payload(self, seq: int, sent_ms: float) -> tuple[str, bytes]:
        protocol = self.protocol
        node = f"node-{seq % NODES}"
        env = protocol.new_envelope(
            message_type=protocol.MessageType.TASK_REQUEST, message_id=f"{self.args.run}-{seq:07d}",
            from_agent_id="bench.sender", to_agent_id="bench.worker", target_node_id=node,
            task_id=f"task-{seq}", conversation_id=f"conv-{seq % self.args.conversations}",
            headers={"originNodeId": "bench-pub", "replyNodeId": "bench-pub"},
            # Publish time in ms, read back from the stored row to measure latency.
            payload={"seq": seq, "sentMs": sent_ms, "text": "x" * 64},
        )
        return f"{self.args.prefix}/node/{node}/inbox", protocol.encode(env)

    def run(self) -> dict:
        n, rate = self.args.messages, self.args.rate
        first = last = 0.0
        published = 0
        start = time.monotonic()
        for seq in range(n):
            if rate:
                delay = start + seq / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if not self.window.acquire(timeout=30):
                self.errors["no_puback_for_30s"] += 1
                break
            last = time.time_ns() / 1e6
            first = first or last
            topic, data = self.payload(seq, last)
            info = self.client.publish(topic, data, qos=1)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                self.errors[f"publish:{mqtt.error_string(info.rc)}"] += 1
                self.window.release()
                continue
            published += 1
        self._wait_acked(published)
        self.client.disconnect()
        self.client.loop_stop()
        return {"published": published, "acked": self.acked, "first_publish_ms": first,
                "last_publish_ms": last, "errors": dict(self.errors),
                "cpu_s": round(time.process_time(), 3)}

    def _wait_acked(self, published: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.acked < published and time.monotonic() < deadline:
            time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    pub = Publisher(parse_args(argv))
    pub.connect()
    print(json.dumps(pub.run()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
