"""YAML loading: `extends:` of presets or files, `--set a.b=c` overrides, readable errors."""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .run import CrossSectionErrors, RunConfig

PRESET_DIR = Path(__file__).parent / "presets"
# Keys that select a variant of a discriminated union: a child that changes one replaces the
# parent's mapping instead of merging into it (the old variant's fields would be unknown keys).
_DISCRIMINATORS = ("kind", "estimator")


@dataclass(frozen=True)
class FieldError:
    """One validation problem at a dotted field path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


class ConfigError(ValueError):
    """The config is invalid; `errors` lists every problem by field path."""

    def __init__(self, source: str, errors: list[FieldError]):
        self.source = source
        self.errors = errors
        lines = "\n".join(f"  - {e}" for e in errors)
        super().__init__(f"invalid config {source} ({len(errors)} error(s)):\n{lines}")


def preset_names() -> list[str]:
    """Names usable in `extends:`."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the
    last one without a word, so an earlier `learner:` block would be dropped unseen), and
    reading numbers and booleans as YAML 1.2 does (`_scalars_as_yaml_1_2`)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys yield
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {key!r} appears twice (also at line "
                    f"{seen[key].line + 1}): merge the two", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_INT = re.compile(r"[-+]?(?:[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)\Z")
_FLOAT = re.compile(r"[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?\Z"
                    r"|[-+]?\.(?:inf|Inf|INF)\Z|\.(?:nan|NaN|NAN)\Z")
_BOOL = re.compile(r"(?:true|True|TRUE|false|False|FALSE)\Z")
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_BOOL_TAG = "tag:yaml.org,2002:bool"


def _resolve_numbers_as_yaml_1_2(cls: type) -> None:
    """Have a loader or dumper class take plain scalars matching YAML 1.2's numbers as such."""
    cls.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
    cls.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+.0123456789"))


def _scalars_as_yaml_1_2(loader: type[yaml.SafeLoader]) -> None:
    """Plain scalars read as numbers and booleans the way YAML 1.2 reads them, not 1.1
    (PyYAML's): `010` is ten, not octal eight (`0o10` is eight); `1:30` is text, not ninety
    seconds; `1e-4` is a number, not text; `yes`, `no`, `on` and `off` are text (a setting
    that is a boolean still takes them), only `true` and `false` are booleans. Underscores
    between digits stay allowed (`1_000`)."""
    replaced = (_INT_TAG, _FLOAT_TAG, _BOOL_TAG)
    loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in replaced]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    _resolve_numbers_as_yaml_1_2(loader)
    loader.add_implicit_resolver(_BOOL_TAG, _BOOL, list("tTfF"))

    def integer(self, node) -> int:
        text = self.construct_scalar(node).replace("_", "")
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
        try:
            return sign * int(digits[2:] if base != 10 else digits, base)
        except ValueError as exc:  # past Python's limit on the digits of a decimal
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {text[:20]}... as a number: {exc}",
                node.start_mark) from None

    loader.add_constructor(_INT_TAG, integer)


_scalars_as_yaml_1_2(_UniqueKeyLoader)


class _NumberQuotingDumper(yaml.SafeDumper):
    """YAML's safe dumper, quoting text that YAML 1.1 or 1.2 reads as a number or a
    boolean (`1e5`, `09`, `on`), so that what it writes reads back as written, here and in
    any other reader."""


_resolve_numbers_as_yaml_1_2(_NumberQuotingDumper)  # besides YAML 1.1's, which it keeps


def dump_yaml(data: Any) -> str:
    """`data` as YAML that this loader reads back unchanged, keys in their order."""
    return yaml.dump(data, Dumper=_NumberQuotingDumper, sort_keys=False)


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The mapping a config's YAML text holds (a file's, or inline text); ConfigError for
    invalid YAML, a key given twice or a top level that is not a mapping."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 - safe
    except yaml.YAMLError as exc:
        raise ConfigError(source, [FieldError("", f"not valid YAML: {exc}")]) from exc
    if not isinstance(data, dict):
        raise ConfigError(source, [FieldError("", "the top level must be a mapping")])
    return data


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:  # a folder, an unreadable or binary file
        raise ConfigError(str(path), [FieldError("", f"cannot be read as text: {exc}")]) from exc
    return parse_yaml(text, str(path))


def _resolve_extends(ref: str, base_dir: Path, chain: tuple[str, ...]) -> dict[str, Any]:
    candidate = (base_dir / ref) if ref.endswith((".yaml", ".yml")) else PRESET_DIR / f"{ref}.yaml"
    if not candidate.exists():
        hint = difflib.get_close_matches(ref, preset_names(), n=1)
        tip = f" (did you mean '{hint[0]}'?)" if hint else f"; presets: {', '.join(preset_names())}"
        raise ConfigError(ref, [FieldError("extends", f"unknown preset or file '{ref}'{tip}")])
    return _load_raw(candidate.resolve(), chain)


def _load_raw(path: Path, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    if str(path) in chain:
        raise ConfigError(str(path), [FieldError("extends", "circular extends: " + " -> ".join(chain))])
    data = _read_yaml(path)
    parent_ref = data.pop("extends", None)
    if parent_ref is None:
        return data
    parent = _resolve_extends(str(parent_ref), path.parent, (*chain, str(path)))
    return deep_merge(parent, data)


def resolve_mapping(data: dict[str, Any], base_dir: str | Path = ".") -> dict[str, Any]:
    """Merge an in-memory mapping with its `extends:` chain (e.g. inline YAML)."""
    data = dict(data)
    parent_ref = data.pop("extends", None)
    if parent_ref is None:
        return data
    return deep_merge(_resolve_extends(str(parent_ref), Path(base_dir), ()), data)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Merge `over` into `base`: mappings recursively, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict) and not _switches_variant(old, value):
            out[key] = deep_merge(old, value)
        else:
            out[key] = value
    return out


def _switches_variant(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return any(k in old and k in new and old[k] != new[k] for k in _DISCRIMINATORS)


def apply_overrides(data: dict[str, Any], assignments: list[str] | tuple[str, ...],
                    ) -> dict[str, Any]:
    """Apply `a.b.c=value` items to a raw config mapping as one patch, so that their order
    does not matter unless they set the same key: `algo.loss.eps_low=0.001` before
    `algo.loss.kind=gspo` keeps its value in the new variant, as it does after it."""
    patch: dict[str, Any] = {}
    for item in assignments:
        patch = apply_override(patch, item)
    return deep_merge(data, patch)


def apply_override(data: dict[str, Any], assignment: str) -> dict[str, Any]:
    """Apply `a.b.c=value` (value parsed as YAML) to a raw config mapping."""
    if "=" not in assignment:
        raise ConfigError("--set", [FieldError(assignment, "expected KEY=VALUE, e.g. learner.lr=1e-4")])
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader)  # noqa: S506 - safe
    except yaml.YAMLError as exc:
        value = exc
    if _text_field(parts) and not isinstance(value, str) and not (
            value is None and raw.strip() in ("", "~", "null", "Null", "NULL")):
        value = raw.strip()  # `name=2024`, `task.system_prompt=Answer: 42`: the text itself
    if isinstance(value, yaml.YAMLError):
        raise ConfigError("--set", [FieldError(dotted.strip(), f"value {raw!r} is not valid "
                                               f"YAML: {' '.join(str(value).split())}")])
    patch: dict[str, Any] = {}
    cursor = patch
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    return deep_merge(data, patch)


def _text_field(parts: list[str]) -> bool:
    """Whether the field at dotted `parts` holds text (`str`, or `str | None`): YAML would
    read `2024`, `on` or `a: b` given to it as a number, a boolean or a mapping."""
    from .run import RunConfig

    annotation = _section_at(RunConfig, tuple(parts))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation)) - {type(None)} == {str}
    return annotation is str


def load_raw(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The merged mapping of a config file, its `extends:` chain and overrides."""
    p = Path(path)
    if not p.exists():
        if str(path) in preset_names():
            p = PRESET_DIR / f"{path}.yaml"
        else:
            hint = difflib.get_close_matches(str(path), preset_names(), n=1, cutoff=0.6)
            raise ConfigError(str(path), [FieldError("", "file not found, nor a preset" + (
                f"; did you mean the preset '{hint[0]}'?" if hint else
                f" (presets: {', '.join(preset_names())})"))])
    return apply_overrides(_load_raw(p.resolve()), overrides)


def validate(data: dict[str, Any], source: str = "<config>") -> RunConfig:
    """Validate a raw mapping into a RunConfig, or raise ConfigError listing every problem."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [e for err in exc.errors() for e in _described(err)]) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load, merge and validate a run config (a file path or a preset name)."""
    return validate(load_raw(path, overrides), str(path))


_NAMED = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)+)")


def _described(err: dict[str, Any]) -> list[FieldError]:
    """The problems one validation error stands for: one, or each of RunConfig's checks that
    span sections, listed under the first setting its message names."""
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, CrossSectionErrors):
        return [FieldError(m[1] if (m := _NAMED.search(msg)) else "", msg)
                for msg in cause.messages]
    return [_describe(err)]


def _typed_path(loc: tuple[str, ...]) -> str:
    """`loc` as the dotted key a user types: without the variant names pydantic puts in the
    location of a union's field (`algo.loss.ppo.clip_low` is typed `algo.loss.clip_low`)."""
    current: Any = RunConfig
    typed: list[str] = []
    for part in loc:
        candidates = _models_in(current)
        if part.isdigit() or not candidates:
            typed.append(part)
            continue
        field = next((c.model_fields[part] for c in candidates if part in c.model_fields), None)
        if field is not None:
            typed.append(part)
            current = field.annotation
            continue
        variant = next((c for c in candidates if _tag(c) == part), None)
        if variant is None or len(candidates) < 2:
            typed.append(part)
            current = None
            continue
        current = variant  # a variant's name: not a key
    return ".".join(typed)


def _describe(err: dict[str, Any]) -> FieldError:
    loc = tuple(str(p) for p in err["loc"])
    path = _typed_path(loc)
    if err["type"] == "extra_forbidden":
        known = _fields_at(RunConfig, loc[:-1])
        hint = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        suggestion = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(known)}"
        return FieldError(path, f"unknown key '{loc[-1]}'{suggestion}")
    if err["type"] in ("union_tag_not_found", "union_tag_invalid"):
        tag = str(err.get("ctx", {}).get("discriminator", "kind")).strip("'")
        tags = [t for t in map(_tag, _models_in(_section_at(RunConfig, loc))) if t]
        default = _default_tag(loc)
        given = err.get("input", {}).get(tag) if isinstance(err.get("input"), dict) else None
        what = "name a variant" if given is None else f"{given!r} is not a variant"
        return FieldError(path, f"{what}: set `{tag}` to one of {', '.join(tags)} "
                                f"(the default section is `{tag}: {default}`; a partial "
                                f"section must say which it changes)")
    message = err["msg"].removeprefix("Value error, ")
    return FieldError(path, message)


def _default_tag(loc: tuple[str, ...]) -> str | None:
    """The tag of the default value of the field at `loc` (e.g. 'cispo' for algo.loss)."""
    current: Any = RunConfig()
    for part in loc:
        current = getattr(current, part, None)
        if current is None:
            return None
    return _tag(type(current)) if isinstance(current, BaseModel) else None


def _fields_at(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    """Field names of the section reached by `loc` (following union tags like 'cispo')."""
    names: list[str] = []
    for cls in _models_in(_section_at(model, loc)):
        names.extend(n for n in cls.model_fields if n not in names)
    return names


def _section_at(model: type[BaseModel], loc: tuple[str, ...]) -> Any:
    """The annotation of the section reached by `loc` (following union tags like 'cispo');
    None when `loc` leads nowhere."""
    current: Any = model
    for part in loc:
        if part.isdigit():  # an item of a list: the list's models stay the candidates
            continue
        candidates = _models_in(current)
        nxt = None
        for cls in candidates:
            if part in cls.model_fields:
                nxt = cls.model_fields[part].annotation
                break
            tag_match = [c for c in candidates if _tag(c) == part]
            if tag_match:
                nxt = tag_match[0]
                break
        if nxt is None:
            return None
        current = nxt
    return current


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list):
        return [m for a in typing.get_args(annotation) for m in _models_in(a)]
    return []


def _tag(cls: type[BaseModel]) -> str | None:
    for key in _DISCRIMINATORS:
        field = cls.model_fields.get(key)
        if field is not None and isinstance(field.default, str):
            return field.default
    return None
