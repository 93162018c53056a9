"""One turn of the learning loop, end to end (docs/learning-loop.md): shadow -> label -> retrain -> calibrate ->
candidate policy under policy shadow -> rollout, over two fake deployments whose quality differs by a rule the
gateway is not told: the fast one gets arithmetic wrong, and the judge (a fake computing its verdict from the
question) can tell. Every step is the operator's command; the gateway, deployments and admin API are real
aiohttp servers and the client is the openai SDK."""

from __future__ import annotations

import asyncio
import csv
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from fakes.faulty_vllm import FakeVLLM
from gateway.classifier.scoring import Calibration
from gateway.cli.command import main
from gateway.rollout.labels import JUDGE_SYSTEM, JUDGE_USER
from gateway.server.app import create_app
from gateway.server.settings import Settings
from tests.fixtures.classifier_data import synthetic_rows, write_csv
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, fake_server, metric, policy_yaml, with_deployment

HQ_SHARE = 0.5  # as much as the arithmetic in the traffic: a perfect router sends exactly it
SUM = re.compile(r"(\d+)\s*(?:\+|plus)\s*(\d+)")
NUMBER = re.compile(r"-?\d+")
ARITHMETIC = ["What is {a} + {b}?", "Compute {a} + {b}.", "What's {a} plus {b}?", "Add {a} + {b} for me."]
# A little longer than the sums: the starting model's length prior does not already favour arithmetic.
OTHER = ["What is the capital city of {w}, please?", "Write a short haiku about {w}.",
         "Tell me something interesting about {w}.", "Suggest a friendly name for {w}.",
         "Describe the usual colour of {w} in one line."]
WORDS = ["France", "the sea", "autumn", "a cat", "Peru", "rain", "a bakery", "jazz", "the moon", "Norway",
         "a garden", "winter", "a violin", "Kenya", "coffee", "a lighthouse"]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def prompts(n: int, seed: int) -> list[tuple[str, bool]]:
    """n prompts, half arithmetic: (text, is_arithmetic)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            out.append((rng.choice(ARITHMETIC).format(a=rng.randint(10, 99), b=rng.randint(10, 99)), True))
        else:
            out.append((rng.choice(OTHER).format(w=rng.choice(WORDS)), False))
    return out


def _question(body: dict[str, Any]) -> str:
    return str(body["messages"][-1]["content"])


def hq_answer(body: dict[str, Any]) -> str:
    found = SUM.search(_question(body))
    return f"The answer is {int(found[1]) + int(found[2])}." if found else f"A short reply to: {_question(body)}"


def fast_answer(body: dict[str, Any]) -> str:
    """Right about everything but arithmetic, where it is off by one."""
    found = SUM.search(_question(body))
    return f"The answer is {int(found[1]) + int(found[2]) + 1}." if found else hq_answer(body)


def judge_answer(body: dict[str, Any]) -> str:
    """Reads the gateway's judge prompt: for a sum, the answer with the right final number wins."""
    text = _question(body)
    request = text.split("[Request]\n", 1)[1].split("\n\n[Answer A]\n", 1)[0]
    a = text.split("[Answer A]\n", 1)[1].split("\n\n[Answer B]\n", 1)[0]
    b = text.split("[Answer B]\n", 1)[1].split("\n\nWhich answer is better?", 1)[0]
    found = SUM.search(request)
    if found is None:
        return "TIE"
    right = str(int(found[1]) + int(found[2]))
    a_ok, b_ok = (NUMBER.findall(x)[-1:] == [right] for x in (a, b))
    return "TIE" if a_ok == b_ok else ("A" if a_ok else "B")


class Loop:
    def __init__(self, hq: FakeVLLM, fast: FakeVLLM, judge: FakeVLLM, urls: list[str], workdir: Path) -> None:
        self.hq, self.fast, self.judge, self.urls, self.workdir = hq, fast, judge, urls, workdir
        self.policy_path = workdir / "policy.yaml"
        self.gateway: TestServer | None = None

    def write_policy(self, rules: str, extra: str = "") -> None:
        text = policy_yaml(self.urls[0], self.urls[1], extra, rules=rules)
        self.policy_path.write_text(with_deployment(text, "judge", self.urls[2], "fake-judge"))

    def url(self, path: str = "") -> str:
        assert self.gateway is not None
        return str(self.gateway.make_url(path))

    async def admin(self, method: str, path: str) -> Any:
        async with aiohttp.ClientSession() as http, http.request(method, self.url(path), headers=AUTH) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def send(self, texts: list[str], session: str = "") -> list[tuple[str, str]]:
        """Each prompt through the gateway: (deployment, rule) that served it."""
        served = []
        async with openai.AsyncOpenAI(base_url=self.url("/v1"), api_key="sk-test", max_retries=0) as client:
            for i, text in enumerate(texts):
                headers = {"x-session-id": f"{session}{i}"} if session else {}
                raw = await client.chat.completions.with_raw_response.create(
                    model="auto", messages=[{"role": "user", "content": text}], extra_headers=headers)
                served.append((raw.headers["x-gateway-deployment"], raw.headers["x-gateway-rule"]))
        return served


def cli(*argv: str) -> None:
    assert main(list(argv)) == 0, argv


def hq_shares(served: list[tuple[str, str]], kinds: list[bool]) -> tuple[float, float]:
    """Share of arithmetic and of other prompts served by hq."""
    arith = [dep == "hq" for (dep, _), is_arith in zip(served, kinds, strict=True) if is_arith]
    other = [dep == "hq" for (dep, _), is_arith in zip(served, kinds, strict=True) if not is_arith]
    return sum(arith) / len(arith), sum(other) / len(other)


def base_rows() -> list[dict[str, str]]:
    """The starting model's data: generic synthetic rows, and prompts like this team's whose public labels say
    nothing about arithmetic (fast was as good as hq on 60% of them, of either kind alike)."""
    rows = synthetic_rows(240)
    for i, (text, _) in enumerate(prompts(120, seed=5)):
        q_weak = "0.0" if (i // 2) % 5 < 2 else "1.0"  # i // 2 counts within each kind (they alternate)
        rows.append({"item_id": f"team{i}", "category": "team", "prompt": text, "q_strong": "1.0", "q_weak": q_weak})
    return rows


def write_prompts(path: Path, items: list[tuple[str, bool]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["prompt"])
        writer.writerows([text] for text, _ in items)
    return path


@pytest.fixture
async def loop(aiohttp_server: Callable[..., Any], tmp_path: Path) -> Loop:
    hq = FakeVLLM("fake-hq", answer=hq_answer)
    fast = FakeVLLM("fake-fast", answer=fast_answer)
    judge = FakeVLLM("fake-judge", answer=judge_answer)
    urls = [await fake_server(f, aiohttp_server) for f in (hq, fast, judge)]
    return Loop(hq, fast, judge, urls, tmp_path)


def rules(threshold: float) -> str:
    return f"""
        rules:
          - name: hard-to-hq
            when: {{complexity: {{gte: {threshold!r}}}}}
            use: hq
        classifier: base.json
    """


SHADOW_AND_LABELS = """
shadows:
  - {route: auto, target: "deployment:hq", percent: 100, sample_by: random, max_in_flight: 16}
labels:
  strong: hq
  weak: fast
  judge: {deployment: judge, rate_per_min: 1000, timeout_s: 5}
"""
CANDIDATE = f"""
policies:
  learned:
    classifier: learned.json
    rules:
      - name: hard-to-hq
        when: {{complexity: {{hq_share: {HQ_SHARE}, calibration: learned.calibration.json}}}}
        use: hq
"""
ROLLOUT = """
rollouts:
  - id: learned-1
    route: auto
    candidate: policy:learned
    steps:
      - set_weight: 50
      - pause: {until: {min_samples: 20}}
      - set_weight: 100
    guards:
      error_rate: {slo: 0.2, margin: 0.2}
"""


async def test_one_turn_of_the_loop_sends_arithmetic_to_hq(
    loop: Loop, aiohttp_server: Callable[..., Any], tmp_path: Path, capsys: Any
) -> None:
    # The starting model knows nothing of arithmetic: trained on a small synthetic CSV, calibrated on traffic.
    base_csv = write_csv(tmp_path / "base.csv", base_rows())
    traffic = write_prompts(tmp_path / "traffic.csv", prompts(200, seed=3))
    await asyncio.to_thread(cli, "classifier", "train", "--data", str(base_csv), "--out", str(tmp_path / "base.json"))
    await asyncio.to_thread(cli, "classifier", "calibrate", "--data", str(traffic), "--model",
                            str(tmp_path / "base.json"), "--target-hq-share", str(HQ_SHARE),
                            "--out", str(tmp_path / "base.calibration.json"))
    threshold = Calibration.load(tmp_path / "base.calibration.json").threshold_for_share(HQ_SHARE)
    loop.write_policy(rules(threshold))
    cfg = Settings(policy=str(loop.policy_path), admin_token=ADMIN_TOKEN, policy_poll_s=60, request_log_prompts=1)
    loop.gateway = await aiohttp_server(create_app(cfg))
    held_out = prompts(80, seed=2)
    kinds = [is_arith for _, is_arith in held_out]
    before = hq_shares(await loop.send([t for t, _ in held_out]), kinds)

    # 1. shadow + label: every call served by fast is mirrored to hq and the pair judged.
    loop.write_policy(rules(threshold), SHADOW_AND_LABELS)
    await loop.admin("POST", "/admin/policy/reload")
    served = await loop.send([t for t, _ in prompts(200, seed=1)])
    on_fast = sum(1 for dep, _ in served if dep == "fast")

    async def all_labelled() -> bool:
        done = await metric(loop.gateway, "gateway_labels_total") + await metric(
            loop.gateway, "gateway_labels_skipped_total")
        return done >= on_fast

    await until(all_labelled, timeout_s=30)
    labels = tmp_path / "labels.jsonl"
    await asyncio.to_thread(cli, "shadow", "labels", "--url", loop.url(), "--admin-token", ADMIN_TOKEN,
                            "--out", str(labels))
    assert f"{on_fast} labels (weak_worse" in capsys.readouterr().err

    # 2. retrain on the CSV plus the labels, 3. calibrate the new model on the same traffic.
    await asyncio.to_thread(cli, "classifier", "train", "--data", str(base_csv), "--labels", str(labels),
                            "--labels-weight", "2", "--out", str(tmp_path / "learned.json"))
    await asyncio.to_thread(cli, "classifier", "calibrate", "--data", str(traffic), "--model",
                            str(tmp_path / "learned.json"), "--target-hq-share", str(HQ_SHARE),
                            "--out", str(tmp_path / "learned.calibration.json"))

    # 4. the candidate policy with the new model, under policy shadow: it decides, calls nothing.
    loop.write_policy(rules(threshold), CANDIDATE + "policy_shadow: {candidate: learned}\n")
    await loop.admin("POST", "/admin/policy/reload")
    await loop.send([t for t, _ in prompts(40, seed=4)])
    shadowed = await loop.admin("GET", "/admin/shadow/policy")
    assert shadowed["decisions"]["disagree"] > 0
    assert any(d["decision"]["deployment"] == "hq" for d in shadowed["disagreements"])

    # 5. the rollout of that policy: driven until it is promoted (Healthy), bounded.
    loop.write_policy(rules(threshold), CANDIDATE + ROLLOUT)
    await loop.admin("POST", "/admin/policy/reload")
    # A held step is looked at again only at spaced times (10 s, 30 s, ... after it began: repeated looks
    # spend alpha), so the loop waits on the phase, bounded in time and count, not on a number of batches.
    deadline = time.monotonic() + 240
    for batch in range(2000):
        await loop.send([t for t, _ in prompts(10, seed=100 + batch)], session=f"b{batch}-")
        status = await loop.admin("GET", "/admin/rollouts/auto")
        if status["phase"] == "Healthy" or time.monotonic() > deadline:
            break
    assert status["phase"] == "Healthy" and status["weight_pct"] == 100, status
    assert [t["action"] for t in await loop.admin("GET", "/admin/rollouts/auto/history")][-2:] == [
        "promote", "promoted"]

    after_served = await loop.send([t for t, _ in held_out], session="held-out-")
    assert all(rule.startswith("policy:learned/") for _, rule in after_served)
    after = hq_shares(after_served, kinds)
    print(f"\nheld-out prompts to hq, arithmetic / other: before {before[0]:.0%} / {before[1]:.0%}, "
          f"after one turn of the loop {after[0]:.0%} / {after[1]:.0%}")
    assert after[0] >= before[0] + 0.3 and after[0] >= 0.8  # clearly more arithmetic to hq
    assert after[1] <= before[1]  # and not more of the rest


def test_the_walkthrough_names_every_step_and_quotes_the_judge_prompt() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "learning-loop.md").read_text()
    for command in ("agent-gateway shadow labels", "agent-gateway classifier train", "--labels-weight",
                    "agent-gateway classifier calibrate", "policy_shadow", "agent-gateway rollout status",
                    "agent-gateway rollout promote"):
        assert command in doc, command
    assert JUDGE_SYSTEM in doc and JUDGE_USER.replace("\n", "\\n") in doc  # the doc shows its newlines as \n
