"""Reliability rows about the gateway's memory: slow readers of a big stream, rounds of concurrent streams.

Each row runs against a gateway of its own, so what it measures is its own traffic's memory, not the
earlier rows'. RSS is read from /proc; "after" is read once the gateway has no request open at a
deployment and the allocator had a moment to hand freed pages back.
"""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import aiohttp

from bench.rig import HELLO, Gateway, Row, gather, settled
from gateway.server.settings import Settings

PIECE_BYTES = 4096  # what a slow reader takes off its socket at a time
RCVBUF_BYTES = 32 * 1024  # its socket's receive buffer (Linux doubles it)
SETTLE_S = 3.0  # after the last request: time for the gateway to drop and trim what it freed
STREAM_REQUEST = json.dumps({"model": "auto", "messages": HELLO, "stream": True}).encode()
# One deployment, the fake with faults (big-stream), with timeouts and health checks that a thousand
# streams on two busy cores do not trip: a row must measure memory, not fail over to another fake.
POLICY = """\
version: 1
deployments:
  fast:
    url: http://127.0.0.1:{fast}
    served_model: bench
    timeouts: {{connect_s: 10, read_s: 30, total_s: 120}}
    max_in_flight: 4096
    health: {{interval_s: 5, timeout_s: 5, eject_after_failures: 100000, cooldown_s: 1}}
models:
  auto: {{route: rules}}
default: fast
fallback: [fast]
"""


class PeakRss:
    """Samples a process's RSS every 50 ms while running; `peak_mib` is the highest seen."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw
        self.peak_mib = gw.rss_mib()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.get_running_loop().create_task(self._sample())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _sample(self) -> None:
        while True:
            self.peak_mib = max(self.peak_mib, self._gw.rss_mib())
            await asyncio.sleep(0.05)


async def _slow_reader(gw: Gateway, read_bytes: int, seconds: float) -> int:
    """One client of a 4 MiB stream that reads `read_bytes` of it over `seconds`, then hangs up."""
    url = urlsplit(gw.url)
    assert url.hostname is not None and url.port is not None
    sock = socket.socket()
    # A fixed receive window, as a client on a slow link has: on loopback the kernel would otherwise grow
    # it to megabytes and take in the whole stream for the client, and nothing would ever push back.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (url.hostname, url.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4 * PIECE_BYTES)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                 b"x-fake-fault: big-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(STREAM_REQUEST), STREAM_REQUEST))
    pause_s = seconds * PIECE_BYTES / read_bytes
    got = 0
    try:
        async with asyncio.timeout(seconds + 20):
            while got < read_bytes:
                piece = await reader.read(PIECE_BYTES)
                if not piece:
                    break
                got += len(piece)
                await asyncio.sleep(pause_s)
    except (TimeoutError, ConnectionError):
        pass
    finally:
        writer.transport.abort()  # gone mid-stream, as a client that gives up is
    return got


async def slow_readers(
    http: aiohttp.ClientSession, gw: Gateway, n: int, read_kib: int, seconds: float
) -> Row:
    """n clients each read `read_kib` of a 4 MiB stream over `seconds`, then leave."""
    before = gw.rss_mib()
    async with PeakRss(gw) as peak:
        got = await gather(n, n, lambda _: _slow_reader(gw, read_kib * 1024, seconds))
    left = await settled(http, gw)
    await asyncio.sleep(SETTLE_S)
    after = gw.rss_mib()
    read = sum(1 for g in got if g >= read_kib * 1024)
    per_reader_kib = (peak.peak_mib - before) * 1024 / n
    # What one slow reader may cost the gateway at its peak: the relay's bound (upstream/client.py's high-water
    # mark and read size, aiohttp's write buffer: ~200 KiB) plus the stream tally (openai.StreamTally keeps
    # up to 256 KiB of a stream, to estimate its tokens should no usage chunk come); and, shared among them, the
    # streams' transcripts for resumes (one bound for all streams: AGENT_GATEWAY_RESUME_MEMORY_BYTES).
    budget_kib = 512 + Settings().resume_memory_bytes / 1024 / n
    return Row(f"{n} slow readers of a 4 MiB stream ({read_kib} KiB each over {seconds:g} s)", n,
               f"peak RSS < 512 KiB a reader, plus the resume memory's share ({budget_kib - 512:.0f} KiB), over "
               "the start; within 16 MiB of it after they left",
               f"{read}/{n} read it; RSS {before:.0f} -> peak {peak.peak_mib:.0f} ({per_reader_kib:.0f} KiB a "
               f"reader) -> after {after:.0f} MiB", read == n and left and per_reader_kib < budget_kib
               and after - before < 16)


async def _stream(http: aiohttp.ClientSession, gw: Gateway) -> bool:
    async with http.post(gw.url + "/v1/chat/completions", data=STREAM_REQUEST,
                         headers={"content-type": "application/json"}) as resp:
        text = await resp.text()
        return resp.status == 200 and text.rstrip().endswith("data: [DONE]")


async def stream_rounds(gw: Gateway, yardstick: Gateway, rounds: int, n: int, every_round: bool = False) -> Row:
    """`rounds` rounds of n concurrent 64-chunk streams through the gateway, then the same through the minimal
    proxy in front of the same deployment; RSS once each round has left (shown for rounds 1, 3 and the last, or for
    every round).

    Both keep the clients' 1,000 connections open between rounds. The minimal proxy keeps nothing else, yet its RSS
    steps up by some MiB from round 1 to 2 or 3 and is flat after: the allocator's pages for the peak of a round
    (CPython's arenas, freed only when wholly empty, and glibc's heap), not anything a request leaves behind. So the
    gateway's growth from round 1 is read against the yardstick's in the same run, and growth after round 3 must
    stop."""
    before = gw.rss_mib()
    good, after = await _rounds(gw, rounds, n, settle=True)
    stick_good, stick_after = await _rounds(yardstick, rounds, n, settle=False)
    shown_rounds = range(1, rounds + 1) if every_round else sorted({1, min(3, rounds), rounds})
    shown = ", ".join(f"{i}: {after[i - 1]:.1f}" for i in shown_rounds)
    stick_shown = ", ".join(f"{i}: {stick_after[i - 1]:.1f}" for i in shown_rounds)
    # Caches fill up over the first rounds (the explain memory keeps the last 2,048 decisions, ~1 KB each): growth
    # must stop after them, not go on with every round.
    late_growth = after[-1] - after[min(3, rounds) - 1]
    growth, stick_growth = after[-1] - after[0], stick_after[-1] - stick_after[0]
    return Row(f"{rounds} rounds of {n} concurrent 64-chunk streams", rounds * n,
               "all 200 + [DONE]; RSS stops growing after round 3 (< 2 MiB more by the last); from round 1 to the "
               "last, within 2 MiB of what the minimal proxy grows in the same rounds",
               f"{good}/{rounds * n} whole; RSS {before:.0f} MiB, after rounds {shown} MiB ({growth:+.1f}); the "
               f"minimal proxy {stick_good}/{rounds * n} whole, after rounds {stick_shown} MiB ({stick_growth:+.1f})",
               good == stick_good == rounds * n and late_growth < 2 and growth - stick_growth < 2)


async def _rounds(target: Gateway, rounds: int, n: int, settle: bool) -> tuple[int, list[float]]:
    """Whole streams over `rounds` rounds of n concurrent ones, and the target's RSS after each round. `settle`: wait
    until the gateway has no request open at a deployment first (the minimal proxy has no metrics to ask; its
    clients have read each stream to its end)."""
    after: list[float] = []
    good = 0
    connector = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        for _ in range(rounds):
            good += sum(await gather(n, n, lambda _: _stream(http, target)))
            if settle:
                await settled(http, target)
            await asyncio.sleep(SETTLE_S)
            after.append(target.rss_mib())
    return good, after


async def padded_headers(gw: Gateway, n: int) -> Row:
    """n requests each carrying 400 KB of headers no rule reads (aiohttp takes 128 lines of 8 KiB)."""
    padding = {f"x-pad-{i}": "v" * 8000 for i in range(50)}
    body = json.dumps({"model": "auto", "messages": HELLO}).encode()
    before = gw.rss_mib()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async def one(_: int) -> bool:
            async with http.post(gw.url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", **padding}) as resp:
                await resp.read()
                return resp.status == 200

        good = sum(await gather(n, 8, one))
        await settled(http, gw)
    await asyncio.sleep(SETTLE_S)
    grown = gw.rss_mib() - before
    # The explain memory keeps the last 2,048 decisions: with the headers, these n would stay (~0.4 MB each).
    return Row(f"{n} requests with 400 KB of headers", n, "200; RSS after grows < 32 MiB (headers not kept)",
               f"{good}/{n} 200; RSS {before:.0f} -> {before + grown:.0f} MiB ({grown:+.0f})",
               good == n and grown < 32)
