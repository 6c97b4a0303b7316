"""An agent written with the A2A-over-MQTT profile's own SDK (`a2a-over-mqtt` on PyPI), run
as a process of its own so that a test can stop it gracefully (SIGTERM: the SDK republishes
its card offline) or kill it (SIGKILL: the broker publishes its Last Will).

    python tests/profile_agent.py --host H --port P --org O --unit U --agent A [--skill S]...

It prints "ready" once its card is published, and answers every request with an artifact
echoing the request's text. With `--ask AGENT` it is the SDK's Requester instead: it sends
`--text` to AGENT (in the same org and unit) as its task `--task`, prints each reply as a
JSON line [kind, content], and exits after the stream ends (or times out, after the
profile's attempts: `--first-reply` seconds each, 3 attempts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from a2a_over_mqtt import A2ARequest, MqttConfig, Requester, Responder, TopicSpace, build_card


class Echo(Responder):
    async def on_request(self, request, stream) -> str:
        await stream(f"echoing {len(request.text)} characters")
        return f"echo: {request.text}"


async def ask(args: argparse.Namespace) -> None:
    requester = Requester(MqttConfig(host=args.host, port=args.port),
                          TopicSpace(org=args.org, unit=args.unit), requester_id=args.agent,
                          first_reply_timeout=args.first_reply, stream_idle_timeout=10.0)
    request = A2ARequest(text=args.text, request_id="req-1", task_id=args.task)
    async for kind, content in requester.stream(args.ask, request.to_json(), args.task[:16]):
        print(json.dumps([kind, content]), flush=True)


async def main(args: argparse.Namespace) -> None:
    if args.ask:
        await ask(args)
        return
    card = build_card(
        name=f"Echo {args.agent}", description="Echoes the text it is sent",
        url=f"mqtt://{args.host}:{args.port}", version=args.version,
        skills=[{"id": s, "name": s.title(), "description": f"the {s} skill", "tags": [s]}
                for s in args.skill or ["echo"]])
    agent = Echo(agent_id=args.agent, mqtt=MqttConfig(host=args.host, port=args.port),
                 topics=TopicSpace(org=args.org, unit=args.unit), card=card)
    task = asyncio.create_task(agent.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    await asyncio.sleep(0.5)  # run() connects and publishes its retained card first
    print("ready", flush=True)
    try:
        await task
    except asyncio.CancelledError:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("host", "org", "unit", "agent"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--version", default="1.0.0")
    parser.add_argument("--skill", action="append")
    parser.add_argument("--ask", default="")
    parser.add_argument("--text", default="hello")
    parser.add_argument("--task", default="")
    parser.add_argument("--first-reply", type=float, default=15.0)
    asyncio.run(main(parser.parse_args()))
