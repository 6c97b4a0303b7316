"""An agent written with the A2A-over-MQTT profile's own SDK (`a2a-over-mqtt` on PyPI), run
as a process of its own so that a test can stop it gracefully (SIGTERM: the SDK republishes
its card offline) or kill it (SIGKILL: the broker publishes its Last Will).

    python tests/profile_agent.py --host H --port P --org O --unit U --agent A [--skill S]...

It prints "ready" once its card is published, and answers every request with an artifact
echoing the request's text.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from a2a_over_mqtt import MqttConfig, Responder, TopicSpace, build_card


class Echo(Responder):
    async def on_request(self, request, stream) -> str:
        await stream(f"echoing {len(request.text)} characters")
        return f"echo: {request.text}"


async def main(args: argparse.Namespace) -> None:
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
    asyncio.run(main(parser.parse_args()))
