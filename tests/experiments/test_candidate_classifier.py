"""A policy names its own classifier model: the live one scores with it, a candidate's decisions with its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.classifier.scoring import Classifier
from gateway.classifier.vocabulary import CharNgrams
from tests.fixtures.stack import ADMIN_TOKEN

HELLO = [{"role": "user", "content": "hello there"}]
RULES = """
rules:
  - name: hard-to-hq
    when: {complexity: {gte: 0.5}}
    use: hq
"""
CANDIDATES = """
classifier: models/low.json
policies:
  learned:
    classifier: models/high.json
  same: {}
policy_shadow: {candidate: learned, percent: 100}
"""


def _constant_model(path: Path, logit: float) -> None:
    path.parent.mkdir(exist_ok=True)
    Classifier(CharNgrams(ngram_min=4, ngram_max=4), {}, [], logit).save(path)


async def test_the_candidate_decides_with_its_own_classifier(make_stack: Callable[..., Any], tmp_path: Path) -> None:
    _constant_model(tmp_path / "models" / "low.json", -4.0)  # scores 0.018: everything fast
    _constant_model(tmp_path / "models" / "high.json", 4.0)  # scores 0.982: everything hq
    stack = await make_stack(CANDIDATES, rules=RULES)
    async with stack.client() as client:
        for _ in range(3):
            raw = await client.chat.completions.with_raw_response.create(model="auto", messages=HELLO)
            assert raw.headers["x-gateway-deployment"] == "fast"  # the live policy's own model (low)
    async with aiohttp.ClientSession() as http:
        url = stack.gateway.make_url("/admin/shadow/policy")
        async with http.get(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            found = await r.json()
    assert found["decisions"] == {"disagree": 3}
    decision = found["disagreements"][0]["decision"]
    assert decision == {"deployment": "hq", "rule": "hard-to-hq"}
