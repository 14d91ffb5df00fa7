"""What every part of the run config shares: strict keys and scalars, and a hook for the part's own rules."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator


class Group(BaseModel):
    # Unknown keys in YAML are mistakes (a typo silently ignored is a lost setting). No setting means anything
    # as inf or NaN (an infinite backoff or retention overflows later, an infinite lr trains NaNs).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _check_scalars(cls, value):
        # Seeds, steps and sizes end up in torch and in int64 table columns: a larger number is a typo that
        # would fail there, after the engines started, rather than here. No path or name holds a NUL byte.
        for v in value if isinstance(value, list) else [value]:
            if type(v) is int and not -(2**63) <= v < 2**63:
                raise ValueError("must fit in a signed 64-bit integer")
            if isinstance(v, str) and "\x00" in v:
                raise ValueError("must not contain a NUL byte")
        return value

    @model_validator(mode="after")
    def _check_invariants(self, info: ValidationInfo):
        # build_config validates the YAML's values and the flags' each on their own first ("fields_only"): the
        # rules between fields hold only for their merge, one source may set a field the other's rule needs.
        context = info.context or {}
        if not context.get("fields_only"):
            self.check(context)
        return self

    def check(self, context: dict[str, Any]) -> None:
        """The rules between this part's own fields: raise ValueError naming the flags. `context` is the
        validation's (its "command": run, eval, replay), which only the whole run config reads."""
