"""Process settings, read once from AGENT_GATEWAY_* environment variables (CLI flags override them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

PREFIX = "AGENT_GATEWAY_"
TRACE_EXPORTERS = ("none", "console", "otlp", "otlp-protobuf")
ENVIRONMENTS = ("development", "production")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = ""  # path of the policy YAML
    max_body_bytes: int = 16 * 1024 * 1024
    admin_token: str = ""  # empty: the admin API is disabled
    traces: str = "none"  # none | console | otlp (OTLP/HTTP protobuf; otlp-protobuf: the same); OTEL_* set the rest
    span_export_nice: int = 10  # how much lower the span export process's priority is (0-19; 0: the same)
    policy_poll_s: float = 1.0
    classifier_model: str = ""  # empty: the packaged default model
    explain_memory: int = 2048  # recent requests whose decision trail /admin/requests/{id}/explain can show
    recurring_bytes: int = 8 * 1024 * 1024  # conversation messages kept parsed by their bytes (apis/recurring.py)
    # streams' bytes kept, all streams together, for a resume to read back (server/resume_splice.py TranscriptMemory)
    resume_memory_bytes: int = 64 * 1024 * 1024
    log_level: str = "INFO"
    workers: int = 1
    redis_url: str = ""  # the shared store when the policy names none (rollout states, arms, shadow pairs)
    request_log: str = ""  # path of the JSONL request log `policy simulate` replays; empty: no log
    request_log_prompts: int = 0  # 1: the request log keeps bodies (prompts); 0: features only
    max_upstream_body_bytes: int = 32 * 1024 * 1024  # a longer non-streamed answer is a deployment failure
    header_timeout_s: float = 10.0  # a request's head (request line and headers) must arrive within this
    objects_dir: str = ""  # the local object store of masked tool outputs when the policy names none (a temp dir)
    upstream_connections: int = 1024  # open connections per deployment at most; more requests wait connect_s
    environment: str = "development"  # production: secrets the gateway needs must be set (no made-up keys)
    compaction_key: str = ""  # seals the compaction items clients send back; production needs it (>= 32 chars)
    # Set by `serve --workers N` for each worker: its number and the folder the workers of this run share.
    worker_index: int = 0
    run_dir: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _convert(f.name, raw, type(getattr(cls(), f.name)))
        settings = cls(**values)
        if settings.traces not in TRACE_EXPORTERS:
            raise ValueError(f"{PREFIX}TRACES={settings.traces!r} is not one of {', '.join(TRACE_EXPORTERS)}")
        if not 0 <= settings.span_export_nice <= 19:
            raise ValueError(f"{PREFIX}SPAN_EXPORT_NICE={settings.span_export_nice!r} is not between 0 and 19")
        if settings.environment not in ENVIRONMENTS:
            raise ValueError(f"{PREFIX}ENVIRONMENT={settings.environment!r} is not one of {', '.join(ENVIRONMENTS)}")
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def _convert(name: str, raw: str, kind: type) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from None


def describe() -> list[tuple[str, str]]:
    """(variable, default) pairs for the README and --help."""
    return [(PREFIX + f.name.upper(), repr(getattr(Settings(), f.name))) for f in fields(Settings)]
