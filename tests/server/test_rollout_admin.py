"""The rollout admin API reads without writing: a GET shows a rollout the leader has not started yet as it will
start, and only a state change (the leader's tick, an explicit POST) writes the store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.server.settings import Settings
from gateway.store.rollouts import RedisRolloutStore
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.stack import ADMIN_TOKEN, OPS_EXTRA, OPS_RULES, three_deployments

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


async def _policy(tmp_path: Path, fake_pair: Any, redis_url: str) -> Path:
    _, hq_server, _, fast_server = fake_pair
    url = str(hq_server.make_url("")).rstrip("/")
    path = tmp_path / "policy.yaml"
    # the candidate's URL is never called: nothing is sent in these tests
    text = three_deployments(url, str(fast_server.make_url("")).rstrip("/"), url, OPS_EXTRA, rules=OPS_RULES)
    path.write_text(text + f'store: {{redis_url: "{redis_url}"}}\n')
    return path


async def test_a_get_leaves_the_store_unchanged_and_a_post_starts_the_rollout(
    private_redis: RedisServer, fake_pair: Any, gateway_server: Callable[[Settings], Any], tmp_path: Path
) -> None:
    store = RedisRolloutStore(private_redis.url, timeout_s=1.0)
    try:
        # Another replica leads, so this gateway's ticker never starts the rollout: only a request could.
        assert await store.lead("another-replica", 60) is not None
        gateway = await gateway_server(Settings(policy=str(await _policy(tmp_path, fake_pair, private_redis.url)),
                                                admin_token=ADMIN_TOKEN))
        async with aiohttp.ClientSession(headers=ADMIN) as http:
            for path in ("/admin/rollouts", "/admin/rollouts/hq", "/admin/rollouts/hq/history"):
                async with http.get(gateway.make_url(path)) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.get(gateway.make_url("/admin/rollouts/hq")) as resp:
                shown = await resp.json()
            assert await store.read_state("hq") is None  # read only: nothing written
            # shown as the leader will start it, and acted on by that generation
            assert (shown["phase"], shown["generation"], shown["weight_pct"]) == ("Progressing", 1, 0.0)
            act = {"actor": "test", "reason": "hold", "generation": shown["generation"]}
            async with http.post(gateway.make_url("/admin/rollouts/hq/pause"), json=act) as resp:
                assert resp.status == 200, await resp.text()
                paused = await resp.json()
        state = await store.read_state("hq")
        assert state is not None
        assert (state.phase.value, state.generation) == ("Paused", 2) == (paused["phase"], paused["generation"])
        assert [t.action for t in state.history] == ["start", "pause"]  # the start, written with the change
    finally:
        await store.close()
