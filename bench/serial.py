"""Baseline: a one-at-a-time consumer, the loop most teams write first.

Poll one message, call the model, commit, repeat: throughput is one job per model latency.
It reads the same job.requested events from a one-partition topic and calls the same
provider with the same request. Run: ``python -m bench.serial --topic T --count N``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid

import aiohttp
from confluent_kafka import Consumer

from bench.raw_kafka import clients
from bench.skip_locked import call_model
from calmq.kafka import consumer_config

__all__ = ["main"]


async def _run(bootstrap: str, topic: str, count: int, provider_url: str) -> dict[str, float]:
    connection, codec = clients(bootstrap)
    consumer = Consumer(consumer_config(connection, f"bench-serial-{uuid.uuid4()}"))
    consumer.subscribe([topic])
    done = 0
    started = 0.0
    cpu0 = time.process_time()
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 60 + count * 10
        while done < count and time.monotonic() < deadline:
            msg = consumer.poll(0.1)
            if msg is None or msg.error() is not None:
                continue
            if not started:
                started = time.time()
                cpu0 = time.process_time()
            _, event = codec.decode(msg.value() or b"")
            await call_model(session, provider_url, done,
                              {"text": f"job {event['job_id']}", "mode": "success"})
            consumer.commit(message=msg, asynchronous=False)
            done += 1
    consumer.close()
    elapsed = time.time() - started
    # CPU of the loop itself: the interpreter's start-up would dwarf five jobs' worth.
    return {"jobs_per_s": round(done / elapsed, 3), "count": done, "elapsed_s": round(elapsed, 3),
            "cpu_s": round(time.process_time() - cpu0, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serial")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--count", type=int, required=True)
    args = parser.parse_args()
    out = asyncio.run(_run(os.environ["CALMQ_KAFKA_BOOTSTRAP"], args.topic, args.count,
                           os.environ["CALMQ_FAKE_PROVIDER_URL"]))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
