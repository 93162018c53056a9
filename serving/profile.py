"""The colocated HQ + fast pair as data: pydantic models of a serving profile and its YAML loading."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Model values "tiny:small" and "tiny:large" stand for the members of serving.tiny_model's locally built
# family (one tokenizer and chat template; the large member is the small one's network made 4x wider and deeper).
TINY_PREFIX = "tiny:"
TINY_MEMBERS = ("small", "large")
BUILTIN_PROFILES = ("cpu", "gpu")
# vLLM refuses to start when the instances on one GPU together ask for more than is free; leave headroom.
GPU_MEMORY_CEILING = 0.95


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculativeDecoding(Frozen):
    """vLLM's --speculative-config: ngram prompt lookup, or a draft / EAGLE model."""

    method: Literal["ngram", "draft_model", "eagle", "eagle3"]
    num_speculative_tokens: int = Field(ge=1, le=16)
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    model: str | None = None

    @model_validator(mode="after")
    def _method_fits(self) -> SpeculativeDecoding:
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(f"method ngram takes no model (got model={self.model!r})")
            if self.prompt_lookup_max is None:
                raise ValueError("method ngram needs prompt_lookup_max")
            if self.prompt_lookup_min is not None and self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max="
                    f"{self.prompt_lookup_max}"
                )
        elif self.model is None:
            raise ValueError(f"method {self.method} needs a model (the draft or EAGLE head)")
        return self

    def to_json(self) -> str:
        """The JSON value of --speculative-config (unset fields left to vLLM's defaults)."""
        return json.dumps(self.model_dump(exclude_none=True), separators=(",", ":"))


def tiny_member(model: str) -> str | None:
    """The tiny family's member a model value names ("tiny:small" -> "small"), None for any other model."""
    return model.removeprefix(TINY_PREFIX) if model.startswith(TINY_PREFIX) else None


class Deployment(Frozen):
    """One vLLM server of the pair."""

    # A model id or directory; "tiny:<member>" stands for a member of serving.tiny_model's family.
    model: str = Field(min_length=1)
    served_model: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: str | None = None
    speculative: SpeculativeDecoding | None = None
    prefix_caching: bool = True
    max_model_len: int = Field(ge=16)
    # Fraction of the node this deployment gets: GPU memory on gpu, CPU cores on cpu.
    share: float = Field(gt=0, lt=1)
    max_num_seqs: int | None = Field(None, ge=1)
    # vLLM's --tool-call-parser for the model's chat template (hermes: <tool_call> JSON, as Qwen2.5 and the
    # tiny family write it); set, the deployment also gets --enable-auto-tool-choice.
    tool_call_parser: str | None = None
    # Further vLLM engine flags, checked against vLLM's own parser like the generated ones.
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = {}

    @model_validator(mode="after")
    def _tiny_member_exists(self) -> Deployment:
        member = tiny_member(self.model)
        if member is not None and member not in TINY_MEMBERS:
            raise ValueError(
                f"model {self.model!r}: the tiny family has {', '.join(TINY_PREFIX + m for m in TINY_MEMBERS)}"
            )
        return self


class Pair(Frozen):
    hq: Deployment
    fast: Deployment

    def items(self) -> list[tuple[str, Deployment]]:
        return [("hq", self.hq), ("fast", self.fast)]


class Profile(Frozen):
    """A serving profile: where the pair runs and how each deployment is configured."""

    platform: Literal["cpu", "gpu"]
    description: str = ""
    # On one GPU the second instance must see the first's memory already taken, so start them in turn.
    start: Literal["together", "sequential"] = "together"
    startup_timeout_s: float = Field(600.0, gt=0)
    env: dict[str, str] = {}
    deployments: Pair

    @model_validator(mode="after")
    def _pair_fits(self) -> Profile:
        hq, fast = self.deployments.hq, self.deployments.fast
        if hq.port == fast.port:
            raise ValueError(f"deployments.hq.port and deployments.fast.port are both {hq.port}")
        if hq.served_model == fast.served_model:
            raise ValueError(
                f"deployments.hq.served_model and deployments.fast.served_model are both {hq.served_model!r};"
                " the gateway tells the deployments apart by it"
            )
        total = round(hq.share + fast.share, 6)
        ceiling = GPU_MEMORY_CEILING if self.platform == "gpu" else 1.0
        if total > ceiling or (self.platform == "gpu" and total == ceiling):
            raise ValueError(
                f"deployments.hq.share + deployments.fast.share = {hq.share} + {fast.share} = {total}"
                f" must be {'below' if self.platform == 'gpu' else 'at most'} {ceiling} on {self.platform}"
            )
        return self

    def uses_tiny_model(self) -> bool:
        return any(tiny_member(dep.model) is not None for _, dep in self.deployments.items())


class ProfileError(Exception):
    """A profile that cannot be used; each problem is one line naming file, field and value."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.source = source
        self.problems = problems


def load(name_or_path: str | Path) -> Profile:
    """Load a built-in profile by name (cpu, gpu) or a profile YAML file by path."""
    if str(name_or_path) in BUILTIN_PROFILES:
        source = f"serving/{name_or_path}.yaml"
        text = (resources.files("serving") / f"{name_or_path}.yaml").read_text(encoding="utf-8")
    else:
        source = str(name_or_path)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(source, [f"{source}: cannot read: {exc.strerror}"]) from exc
    return parse(text, source)


def parse(text: str, source: str = "<profile>") -> Profile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(source, [f"{source}: not valid YAML: {exc}"]) from exc
    if not isinstance(data, dict):
        raise ProfileError(source, [f"{source}: a profile must be a YAML mapping, got {type(data).__name__}"])
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(source, [describe(source, err) for err in exc.errors()]) from exc


def describe(source: str, err: Mapping[str, Any]) -> str:
    """One line for one pydantic error: file: field: message (value: ...)."""
    field = ".".join(str(part) for part in err["loc"])
    message = str(err["msg"]).removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) or not field else f" (value: {value!r})"
    return f"{source}: {field or '<top>'}: {message}{shown}"
