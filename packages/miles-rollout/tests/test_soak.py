"""Multi-process tier (slow): 64 concurrent HTTP clients for 30 s against one server — no errors, bounded
memory (KV pages within the configured bound, server RSS growth bounded), and the server still healthy."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest

from miles_contracts import GenerateRequest, SamplingParams
from miles_rollout import Client

pytestmark = pytest.mark.slow

NUM_CLIENTS = 64
DURATION_S = 30.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_64_clients_for_30_seconds(dense_dir, start_server) -> None:
    with start_server(dense_dir, "--num-kv-pages", "256", "--max-running-requests", "32") as url:
        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
        pid = info["pid"]

        async def worker(client: Client, seed: int, stop_at: float, counts: dict[str, int], done: list[int]) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop_at:
                prompt = [rng.randrange(512) for _ in range(rng.randint(1, 120))]
                params = SamplingParams(max_new_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 1.0]),
                                        top_p=rng.choice([1.0, 0.9]), n=rng.choice([1, 1, 2]))  # fmt: skip
                try:
                    responses = await client.generate(GenerateRequest(input_ids=prompt, sampling_params=params))
                    counts["ok"] += 1
                    done[seed] += 1
                    counts["tokens"] += sum(len(r.output_ids) for r in responses)
                except Exception as error:  # counted, then reported by the assertion below
                    counts["errors"] += 1
                    counts.setdefault("first_error", repr(error))  # type: ignore[arg-type]

        async def run() -> tuple[dict[str, int], list[int], float, int]:
            counts = {"ok": 0, "errors": 0, "tokens": 0}
            done = [0] * NUM_CLIENTS  # requests each client completed
            async with Client(url, timeout=120) as client:
                await client.generate(GenerateRequest(input_ids=[1], sampling_params=SamplingParams(max_new_tokens=1)))
                rss_before = rss_mib(pid)
                stop_at = time.monotonic() + DURATION_S
                peak_pages = 0
                tasks = [asyncio.create_task(worker(client, i, stop_at, counts, done)) for i in range(NUM_CLIENTS)]
                while not all(t.done() for t in tasks):
                    peak_pages = max(peak_pages, (await client.get_server_info())["num_used_pages"])
                    await asyncio.sleep(0.5)
                await asyncio.gather(*tasks)
                return counts, done, rss_mib(pid) - rss_before, peak_pages

        counts, done, rss_growth, peak_pages = asyncio.run(run())
        assert counts["errors"] == 0, counts
        assert min(done) > 0, f"clients that completed no request: {[i for i, n in enumerate(done) if n == 0]}"
        assert peak_pages <= 255
        assert rss_growth < 300, f"server RSS grew {rss_growth:.0f} MiB"
        assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
        print(f"soak: {counts['ok']} requests, {counts['tokens']} tokens, RSS +{rss_growth:.0f} MiB, "
              f"peak {peak_pages} pages")  # fmt: skip
