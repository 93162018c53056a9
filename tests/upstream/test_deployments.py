"""Reading a deployment's load from vLLM's /metrics text: one engine or several."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from fakes.faulty_vllm import Fault
from gateway.upstream.deployments import parse_metrics
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack

HELLO = [{"role": "user", "content": "hi"}]

# What a vLLM server with two data-parallel engines exposes (one label set per engine).
TWO_ENGINES = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.2
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 100.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="tiny"} 50.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="tiny"} 20.0
"""


def test_several_engines_average_the_kv_cache_and_add_up_the_counts() -> None:
    figures = parse_metrics(TWO_ENGINES)
    # Summed, two engines at 0.6 and 0.2 read as 0.8 full (and four engines at half as 2.0, "full").
    assert figures["vllm:kv_cache_usage_perc"] == pytest.approx(0.4)
    assert figures["vllm:num_requests_running"] == 4.0
    assert figures["vllm:num_requests_waiting"] == 2.0
    assert figures["vllm:spec_decode_num_draft_tokens_total"] == 150.0
    assert figures["vllm:spec_decode_num_accepted_tokens_total"] == 60.0


def test_four_half_full_engines_are_half_full() -> None:
    text = "".join(f'vllm:kv_cache_usage_perc{{engine="{i}"}} 0.5\n' for i in range(4))
    assert parse_metrics(text)["vllm:kv_cache_usage_perc"] == 0.5


def test_one_engine_reads_as_it_is() -> None:
    text = 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.97\nvllm:num_requests_waiting 5\n'
    assert parse_metrics(text) == {"vllm:kv_cache_usage_perc": 0.97, "vllm:num_requests_waiting": 5.0}


async def test_probes_are_not_queued_behind_requests_at_the_connection_limit(make_stack: Any) -> None:
    """The main pool holds one connection per deployment here, and a held request keeps fast's busy:
    its /health probes must still reach it (sharing that pool, they waited and failed)."""
    stack: Stack = await make_stack(settings={"upstream_connections": 1}, read_s="30")
    stack.fast.faults.append(Fault(hold=True))
    async with stack.client() as client:
        held = asyncio.ensure_future(client.chat.completions.create(model="fast", messages=HELLO))
        try:
            await until(lambda: len(stack.fast.received) == 1, what="the held request reached fast")
            probed = stack.fast.probes
            await until(lambda: stack.fast.probes >= probed + 3, what="three more probes reached fast")
            assert not held.done()  # still holding the main pool's only connection to fast
            async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/readyz")) as resp:
                assert "fast" in (await resp.json())["healthy_deployments"]
        finally:
            stack.fast.release.set()
            await held
