"""The rollout and shadow sections of the policy YAML, as frozen pydantic models with their validation."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from gateway.frozen import Frozen
from gateway.rollout.stats import FINAL_ALPHA, INTERIM_ALPHA

_TARGET = re.compile(r"^(deployment|policy):[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_KEY = re.compile(r"^(header:[A-Za-z0-9\-]+|user|api_key|tenant|session)$")

Target = Annotated[
    str,
    Field(
        description="what serves a cohort: 'deployment:NAME' or 'policy:NAME'", examples=["deployment:hq-v2"]
    ),
]


class _Model(Frozen):
    pass


def _check_target(value: str) -> str:
    if not _TARGET.match(value):
        raise ValueError(f"target {value!r} must be 'deployment:NAME' or 'policy:NAME'")
    return value


class Until(_Model):
    min_samples: int = Field(ge=1, description="candidate requests needed in this step before it may end")


class Pause(_Model):
    """`pause: {}` waits for a human; with duration_s and/or until it is a timed observation window."""

    duration_s: float | None = Field(default=None, gt=0)
    until: Until | None = None

    @property
    def manual(self) -> bool:
        return self.duration_s is None and self.until is None


class Analysis(_Model):
    """An explicit end-of-step check: hold until every listed guard passes (or one fails)."""

    guards: tuple[Literal["error_rate", "ttft_p95", "tpot_p95", "shadow_quality", "tool_error_rate",
                          "rework_rate", "task_success_rate", "cost_per_success"], ...] | None = None
    min_samples: int = Field(default=0, ge=0, description="candidate requests needed before the check")
    alpha: float | None = Field(default=None, gt=0, lt=0.5)


class Shadow(_Model):
    percent: float = Field(
        ge=0, le=100, description="share of stable-served requests mirrored to the candidate"
    )


class SetWeightStep(_Model):
    set_weight: float = Field(description="candidate share of traffic in percent, (0, 100]")

    @field_validator("set_weight")
    @classmethod
    def _in_range(cls, value: float) -> float:
        if not 0 < value <= 100:
            raise ValueError(f"set_weight must be in (0, 100], got {value:g}")
        return value


class PauseStep(_Model):
    pause: Pause


class AnalysisStep(_Model):
    analysis: Analysis


class ShadowStep(_Model):
    shadow: Shadow


Step = SetWeightStep | PauseStep | AnalysisStep | ShadowStep
_STEP_KINDS: dict[str, type[Step]] = {
    "set_weight": SetWeightStep,
    "pause": PauseStep,
    "analysis": AnalysisStep,
    "shadow": ShadowStep,
}


class ErrorRateGuard(_Model):
    slo: float = Field(
        default=0.02, gt=0, lt=1, description="absolute error-rate SLO; a proven breach aborts"
    )
    margin: float = Field(default=0.02, ge=0, lt=1, description="allowed excess over control's error rate")


class LatencyGuard(_Model):
    margin: float = Field(
        default=0.05, ge=0, lt=0.95, description="allowed excess share of requests above control's p95"
    )
    min_control_samples: int = Field(default=20, ge=1, description="per stratum, to trust control's p95")


class ShadowQualityGuard(_Model):
    margin: float = Field(
        default=0.05, ge=0, lt=0.5, description="candidate win share may be as low as 0.5 - margin"
    )


class ProcessGuard(_Model):
    """An agent process rate (higher is worse) of the candidate's sessions against control's."""

    margin: float = Field(default=0.05, ge=0, lt=1, description="allowed excess over control's rate")


class TaskSuccessGuard(_Model):
    """The success rate of the candidate's agent sessions (as their callers report it) against control's."""

    margin: float = Field(default=0.05, ge=0, lt=1, description="allowed drop below control's success rate")
    min_sessions: int = Field(default=20, ge=1, description="sessions with an outcome per cohort before a verdict")


class CostPerSuccessGuard(_Model):
    """The candidate's spend per solved task (all its sessions' cost / its successes) against control's."""

    max_ratio: float = Field(default=1.1, gt=0, description="candidate's cost per success over control's, at most")
    min_sessions: int = Field(default=20, ge=1, description="sessions with an outcome per cohort before a verdict")


class Guards(_Model):
    error_rate: ErrorRateGuard | None = ErrorRateGuard()
    ttft_p95: LatencyGuard | None = None
    tpot_p95: LatencyGuard | None = None
    shadow_quality: ShadowQualityGuard | None = None
    tool_error_rate: ProcessGuard | None = None  # tool outputs sent back as errors / all tool outputs
    rework_rate: ProcessGuard | None = None  # steps repeating a tool call of their session / tool-call steps
    task_success_rate: TaskSuccessGuard | None = None  # sessions reported a success / sessions with an outcome
    cost_per_success: CostPerSuccessGuard | None = None  # spend of sessions with an outcome / their successes


class RolloutSpec(_Model):
    """One route's rollout of a candidate target, in declared steps."""

    id: str = Field(min_length=1, max_length=128, description="rollout id, also the bucketing salt")
    route: str | None = Field(default=None, description="the client model name (route) it applies to")
    candidate: Target
    stable: Target | None = Field(
        default=None, description="what the candidate replaces; checked against the route"
    )
    steps: tuple[Step, ...] = Field(min_length=1)
    guards: Guards = Guards()
    key: tuple[str, ...] = ("header:x-session-id", "user", "api_key")
    max_hold_s: float = Field(default=1800.0, gt=0, description="inconclusive this long at a step -> pause")
    alpha: float = Field(default=FINAL_ALPHA, gt=0, lt=0.5, description="end-of-step significance level")
    interim_alpha: float = Field(
        default=INTERIM_ALPHA, gt=0, lt=0.5, description="interim (abort-only) level"
    )

    @field_validator("steps", mode="before")
    @classmethod
    def _known_kinds(cls, raw: object) -> object:
        if isinstance(raw, list | tuple):
            for i, item in enumerate(raw):
                kinds = list(item) if isinstance(item, dict) else []
                if len(kinds) != 1 or kinds[0] not in _STEP_KINDS:
                    raise ValueError(
                        f"steps[{i}]: {item!r} is not a step; each step is exactly one of "
                        f"{sorted(_STEP_KINDS)}"
                    )
            return [_step(i, item) for i, item in enumerate(raw)]
        return raw

    @field_validator("candidate", "stable")
    @classmethod
    def _targets(cls, value: str | None) -> str | None:
        return None if value is None else _check_target(value)

    @field_validator("key")
    @classmethod
    def _keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("key needs at least one source, e.g. [header:x-session-id, user, api_key]")
        for item in value:
            if not _KEY.match(item):
                raise ValueError(f"key source {item!r} must be header:NAME, user, api_key, tenant or session")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> RolloutSpec:
        if self.stable is not None and self.stable == self.candidate:
            raise ValueError(f"candidate {self.candidate!r} is the stable target itself")
        if self.interim_alpha > self.alpha:
            raise ValueError(f"interim_alpha {self.interim_alpha:g} must not exceed alpha {self.alpha:g}")
        _check_weights(self.steps)
        return self


def _step(index: int, item: dict[str, object]) -> Step:
    kind = next(iter(item))
    try:
        return _STEP_KINDS[kind](**item)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"steps[{index}].{where}: {first['msg'].removeprefix('Value error, ')}") from None


def _check_weights(steps: tuple[Step, ...]) -> None:
    weight = 0.0
    for i, step in enumerate(steps):
        if isinstance(step, SetWeightStep):
            if step.set_weight <= weight:
                raise ValueError(
                    f"steps[{i}]: set_weight {step.set_weight:g} must be above the previous weight {weight:g}"
                )
            weight = step.set_weight
        elif weight >= 100 and (
            isinstance(step, AnalysisStep) or (isinstance(step, PauseStep) and not step.pause.manual)
        ):
            # At 100% there is no control cohort left to compare with, so the check could never conclude.
            raise ValueError(
                f"steps[{i}]: an analysis or timed pause after set_weight 100 has no control cohort"
            )


class ShadowSpec(_Model):
    """A standing shadow of a route's traffic onto a target, compared but never returned to the client."""

    target: Target
    route: str | None = Field(default=None, description="the client model name (route) it mirrors")
    percent: float = Field(gt=0, le=100)
    sample_by: Literal["key", "random"] = "key"
    max_in_flight: int = Field(default=8, ge=1, description="over this the shadow is dropped, never queued")
    timeout_s: float = Field(default=30.0, gt=0)
    max_tokens: int = Field(default=512, ge=1)
    judge: bool = False

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        return _check_target(value)


def check_route(
    route: str, stable: str | None, rollouts: Iterable[RolloutSpec], shadows: Iterable[ShadowSpec] = ()
) -> None:
    """Route-level checks for the policy loader where routes are declared; ValueError names the route."""
    declared = list(rollouts)
    if len(declared) > 1:
        ids = ", ".join(r.id for r in declared)
        raise ValueError(f"route {route!r}: at most one rollout per route, found {len(declared)} ({ids})")
    for spec in declared:
        if stable is not None and spec.candidate == stable:
            raise ValueError(
                f"route {route!r}: rollout {spec.id!r} candidate {spec.candidate!r} "
                "is the route's stable target"
            )
        if stable is not None and spec.stable is not None and spec.stable != stable:
            raise ValueError(
                f"route {route!r}: rollout {spec.id!r} says stable is {spec.stable!r} "
                f"but the route serves {stable!r}"
            )
    for shadow in shadows:
        if stable is not None and shadow.target == stable:
            raise ValueError(f"route {route!r}: shadow of the stable target {stable!r} onto itself")


def problems(
    rollouts: Iterable[RolloutSpec],
    shadows: Iterable[ShadowSpec] = (),
    *,
    stable_of: Mapping[str, str],
    deployments: Collection[str],
    policies: Collection[str] = (),
) -> Iterator[str]:
    """Policy-level checks of `rollouts:` / `shadows:` lists: one message per problem, naming the field.

    stable_of maps each route (client model name) to the target serving it now, e.g.
    {"auto": "policy:live", "hq": "deployment:hq"}.
    """
    by_route: dict[str, list[int]] = {}
    for i, spec in enumerate(rollouts):
        yield from _target_problems(
            f"rollouts[{i}]", spec.route, spec.candidate, stable_of, deployments, policies
        )
        if spec.route is not None:
            by_route.setdefault(spec.route, []).append(i)
            stable = stable_of.get(spec.route)
            if stable is not None and spec.stable is not None and spec.stable != stable:
                served = f"route {spec.route!r} is served by {stable!r}"
                yield f"rollouts[{i}].stable: {spec.stable!r} but {served}"
    for route, indexes in by_route.items():
        if len(indexes) > 1:
            n = len(indexes)
            yield f"rollouts: route {route!r} has {n} rollouts (items {indexes}); at most one per route"
    for i, shadow in enumerate(shadows):
        yield from _target_problems(
            f"shadows[{i}]", shadow.route, shadow.target, stable_of, deployments, policies
        )


def _target_problems(
    where: str,
    route: str | None,
    target: str,
    stable_of: Mapping[str, str],
    deployments: Collection[str],
    policies: Collection[str],
) -> Iterator[str]:
    if route is None:
        yield f"{where}.route: missing (which client model does it apply to?)"
    elif route not in stable_of:
        yield f"{where}.route: unknown route {route!r} (known: {sorted(stable_of)})"
    elif stable_of[route] == target:
        yield f"{where}: {target!r} is the stable target of route {route!r}: a shadow or rollout onto itself"
    kind, _, name = target.partition(":")
    known = deployments if kind == "deployment" else policies
    if name not in known:
        yield f"{where}: unknown {kind} {name!r} (known: {sorted(known)})"
