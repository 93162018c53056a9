"""Sticky, monotone assignment of requests to a rollout's arms by hash of a key chain."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.rollout.state import Arm, Phase, RolloutState

_SERVING = (Phase.PROGRESSING, Phase.PAUSED, Phase.PROMOTING, Phase.HEALTHY)


def bucket(salt: str, key: str) -> float:
    """A key's fixed position in [0, 1) for one salt; the NUL keeps ("ab", "c") and ("a", "bc") apart."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def sticky_key(
    chain: Sequence[str],
    *,
    headers: Mapping[str, str],
    user: str | None = None,
    api_key: str | None = None,
    tenant: str | None = None,
    session: str | None = None,
) -> str | None:
    """The first present source of the chain as "source=value" (so equal values of two sources differ)."""
    named = {"user": user, "api_key": api_key, "tenant": tenant, "session": session}
    for source in chain:
        if source.startswith("header:"):
            name = source.removeprefix("header:")
            value = headers.get(name) or headers.get(name.lower())
        else:
            value = named.get(source)
        if value:
            return f"{source}={value}"
    return None


def assign(state: RolloutState | None, key: str | None) -> Arm:
    """The arm of a key: candidate owns [0, w), control [w, 2w); no state or an abort means stable."""
    if state is None or state.phase not in _SERVING or state.weight_pct <= 0:
        return Arm.STABLE
    if state.weight_pct >= 100:
        return Arm.CANDIDATE
    if key is None:
        return Arm.STABLE  # unkeyed requests cannot be kept sticky, so they are never put at risk
    position = bucket(state.rollout_id, key) * 100.0
    if position < state.weight_pct:
        return Arm.CANDIDATE
    if position < 2 * state.weight_pct:
        return Arm.CONTROL
    return Arm.STABLE


@dataclass(frozen=True, slots=True)
class Assignment:
    """The arm an agent session got on first sight, recorded in the store for the session's lifetime."""

    rollout_id: str
    run: int
    arm: Arm

    def encode(self) -> str:
        return f"{self.run}|{self.arm.value}|{self.rollout_id}"

    @classmethod
    def decode(cls, raw: str) -> Assignment | None:
        """None for anything unreadable: the session is then simply assigned afresh."""
        try:
            run, arm, rollout_id = raw.split("|", 2)
            return cls(rollout_id, int(run), Arm(arm))
        except ValueError:
            return None


def assign_session(
    state: RolloutState | None, key: str | None, recorded: Assignment | None
) -> Assignment | None:
    """A session's arm: the recorded one while the same rollout run lasts, stable once it aborts.

    Returns None when there is no rollout. The caller records the result when it differs from
    `recorded` (SET NX: if another replica recorded first, it uses that one instead).
    """
    if state is None:
        return None
    if state.phase is Phase.ABORTED:
        return Assignment(state.rollout_id, state.run, Arm.STABLE)
    if recorded is not None and recorded.rollout_id == state.rollout_id and recorded.run == state.run:
        return recorded
    return Assignment(state.rollout_id, state.run, assign(state, key))


def shadow_sampled(state: RolloutState | None, arm: Arm, key: str | None) -> bool:
    """Whether a stable-served request is mirrored to the candidate under the rollout's shadow step."""
    if state is None or arm is Arm.CANDIDATE or state.shadow_pct <= 0 or key is None:
        return False
    if state.phase not in (Phase.PROGRESSING, Phase.PAUSED):
        return False
    return bucket(f"{state.rollout_id}/shadow", key) * 100.0 < state.shadow_pct
