"""A policy section reads its fields as a plain object does (gateway/_plain_getattr.c), with pydantic's answers."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel, PrivateAttr, ValidationError

from gateway import frozen
from gateway.frozen import Frozen
from gateway.policy import model

# Where the extension did not compile outside CI, the tests that need it skip (the models keep pydantic's hook);
# in CI they all run, and the build check fails.
needs_extension = pytest.mark.skipif(frozen.plain_getattr is None and os.environ.get("CI") != "true",
                                     reason="the optional C extension did not build")


class Section(Frozen):
    name: str
    weight_pct: float = 1.0

    @property
    def doubled(self) -> float:
        return self.weight_pct * 2


@needs_extension
def test_every_policy_section_reads_its_fields_with_the_generic_lookup() -> None:
    assert frozen.plain_getattr is not None, "gateway/_plain_getattr.c did not build: setup.py build_ext --inplace"
    sections = [c for c in vars(model).values() if isinstance(c, type) and issubclass(c, Frozen) and c is not Frozen]
    assert len(sections) > 10
    for section in [Section, *sections]:
        assert frozen.plain_getattr.uses_generic_getattr(section), section
    assert not frozen.plain_getattr.uses_generic_getattr(BaseModel)  # pydantic itself is left as it is


class Plain(BaseModel):  # the same fields through pydantic's own hook: the reference
    name: str
    weight_pct: float = 1.0


def test_fields_properties_and_methods_read_as_pydantic_reads_them() -> None:
    section, reference = Section(name="hq", weight_pct=2.5), Plain(name="hq", weight_pct=2.5)
    assert (section.name, section.weight_pct, section.doubled) == (reference.name, reference.weight_pct, 5.0)
    assert section.model_dump() == reference.model_dump()
    assert section.model_copy(update={"name": "fast"}).name == "fast"
    assert getattr(section, "missing", None) is None and not hasattr(section, "missing")
    with pytest.raises(AttributeError, match="missing"):
        section.missing  # noqa: B018
    with pytest.raises(ValidationError):
        section.name = "fast"  # frozen all the same
    with pytest.raises(ValidationError):
        Section(name="hq", typo=1)  # type: ignore[call-arg]


def test_a_section_with_private_attributes_or_extras_is_refused_at_its_definition() -> None:
    with pytest.raises(TypeError, match="private"):
        class WithPrivate(Frozen):
            _cache: dict[str, int] = PrivateAttr(default_factory=dict)
    with pytest.raises(TypeError, match="extra"):
        class WithExtras(Frozen, extra="allow"):
            name: str


@needs_extension
def test_only_a_class_defined_in_python_can_be_changed() -> None:
    assert frozen.plain_getattr is not None
    with pytest.raises(TypeError):
        frozen.plain_getattr.use_generic_getattr(int)
    with pytest.raises(TypeError):
        frozen.plain_getattr.uses_generic_getattr(Section(name="x"))  # type: ignore[arg-type]
