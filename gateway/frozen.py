"""The one base of every policy section: frozen (reload swaps whole objects) and strict (a typo is an error)."""

from typing import Any

from pydantic import BaseModel, ConfigDict

try:  # the optional C extension (setup.py) that lets the interpreter read a model's fields as plain attributes
    from gateway import _plain_getattr as plain_getattr
except ImportError:
    plain_getattr = None  # type: ignore[assignment]


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """pydantic's __getattr__ serves private attributes and extras, which a policy section never has; the
        request path reads ~60 fields a call, and through that hook each read is slow and never specialized
        (gateway/_plain_getattr.c): a section's class reads its attributes as a plain object does."""
        super().__pydantic_init_subclass__(**kwargs)
        if cls.__private_attributes__:
            raise TypeError(f"{cls.__name__}: a policy section has no private attributes "
                            f"({', '.join(cls.__private_attributes__)})")
        if cls.model_config.get("extra") != "forbid":
            raise TypeError(f"{cls.__name__}: a policy section forbids extra fields")
        if plain_getattr is not None:
            plain_getattr.use_generic_getattr(cls)
