"""Sessions with outcomes as classifier labels (`sessions export --with-outcomes`): which steps needed the
strong deployment, by what happened to the same task's runs.

A task is the sessions whose outcome labels name the same `task` (an eval case, a ticket), else those that
opened with the same prompt (when prompts are kept), else the session alone. Within a task:

- failed, mostly on `weak`, and a run of the task succeeded mostly on `strong`: its steps are weak_worse
  (q_strong 1, q_weak 0: they needed strong);
- succeeded mostly on `weak`: tie (q_strong 1, q_weak 1: weak was enough);
- anything else (no rerun on strong, a strong run that failed, a mix): no label, counted by reason.

Each label row is what `classifier train --labels` reads (q_strong, q_weak, and the step's prompt as `body`
when the gateway kept prompts: AGENT_GATEWAY_REQUEST_LOG_PROMPTS=1), plus the session, step, deployment and
outcome it came from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NO_OUTCOME = "no outcome"
NO_STRONG_RERUN = "failed, and no run of the task succeeded on the strong deployment"
NOT_ON_WEAK = "not mostly on the weak deployment"
VERDICTS = {"weak_worse": (1.0, 0.0), "tie": (1.0, 1.0)}


@dataclass(slots=True)
class Labelled:
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # sessions without a label, by reason
    sessions: Counter[str] = field(default_factory=Counter)  # sessions labelled, by verdict

    def summary(self) -> str:
        used = ", ".join(f"{v} {n}" for v, n in sorted(self.sessions.items())) or "none"
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        prompts = sum(1 for r in self.rows if "body" in r)
        return (f"{len(self.rows)} label rows from sessions labelled {used} ({prompts} rows with prompt text); "
                f"sessions skipped: {skipped}")


def task_of(session: Mapping[str, Any]) -> str:
    labels = (session.get("outcome") or {}).get("labels") or {}
    if labels.get("task"):
        return "task:" + str(labels["task"])
    steps = session.get("steps") or []
    if steps and steps[0].get("prompt"):
        return "prompt:" + str(steps[0]["prompt"])
    return "session:" + str(session.get("session_id"))


def mostly_on(session: Mapping[str, Any], deployment: str) -> bool:
    used: Mapping[str, int] = session.get("deployments") or {}
    steps = sum(used.values())
    return steps > 0 and used.get(deployment, 0) * 2 > steps


def label(sessions: Sequence[Mapping[str, Any]], strong: str, weak: str) -> Labelled:
    """Label rows for the steps of sessions (as GET /admin/sessions/{id} shows them) by the table above."""
    out = Labelled()
    by_task: dict[str, list[Mapping[str, Any]]] = {}
    for session in sessions:
        if session.get("outcome") is None:
            out.skipped[NO_OUTCOME] += 1
        else:
            by_task.setdefault(task_of(session), []).append(session)
    for task, runs in by_task.items():
        solved_on_strong = any(r["outcome"]["success"] and mostly_on(r, strong) for r in runs)
        for run in runs:
            verdict = _verdict(run, strong, weak, solved_on_strong)
            if verdict not in VERDICTS:
                out.skipped[verdict] += 1
                continue
            out.sessions[verdict] += 1
            out.rows += [_row(run, step, task, strong, weak, verdict) for step in run.get("steps") or []]
    return out


def _verdict(run: Mapping[str, Any], strong: str, weak: str, solved_on_strong: bool) -> str:
    if not mostly_on(run, weak):
        return NOT_ON_WEAK
    if run["outcome"]["success"]:
        return "tie"
    return "weak_worse" if solved_on_strong else NO_STRONG_RERUN


def _row(run: Mapping[str, Any], step: Mapping[str, Any], task: str, strong: str, weak: str,
         verdict: str) -> dict[str, Any]:
    q_strong, q_weak = VERDICTS[verdict]
    row: dict[str, Any] = {
        "at": step.get("at"), "session_id": run.get("session_id"), "tenant": run.get("tenant"),
        "step": step.get("step"), "deployment": step.get("deployment"), "task": task, "strong": strong,
        "weak": weak, "verdict": verdict, "good_enough": verdict == "tie", "q_strong": q_strong, "q_weak": q_weak,
        "source": "outcome", "outcome": run.get("outcome"), "deployments": run.get("deployments"),
        "session_steps": run.get("step_count", run.get("steps")), "endpoint": "chat",
    }  # fmt: skip
    if step.get("prompt"):
        row["body"] = {"messages": [{"role": "user", "content": step["prompt"]}]}
    return row
