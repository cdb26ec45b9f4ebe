"""Typed run configuration (pydantic v2). Importable without torch or transformers."""

from .loader import (
    ConfigError,
    FieldError,
    apply_override,
    apply_overrides,
    deep_merge,
    load_config,
    load_raw,
    preset_names,
    validate,
)
from .run import RunConfig

__all__ = [
    "ConfigError",
    "FieldError",
    "RunConfig",
    "apply_override",
    "apply_overrides",
    "deep_merge",
    "load_config",
    "load_raw",
    "preset_names",
    "validate",
]
