"""Base model shared by every config section: strict, documented, immutable after validation."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ConfigDict, model_validator


def _types(annotation) -> set:
    """The plain types an annotation admits (through unions, Optional and Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_types(a) for a in typing.get_args(annotation)))
    return {annotation}


class Section(BaseModel):
    """A config section: unknown keys are rejected and field docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data):
        """`lr: true` is a mistake, not 1.0: a boolean only where the field takes one."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(value, bool) else None
                if field is not None:
                    admitted = _types(field.annotation)
                    if bool not in admitted and admitted & {int, float}:
                        raise ValueError(f"`{name}` expects a number, got the boolean "
                                         f"{str(value).lower()}")
        return data
