"""The one base of every policy section: frozen (reload swaps whole objects) and strict (a typo is an error)."""

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
