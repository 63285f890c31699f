"""Typed configuration: YAML files plus ``key=value`` overrides, checked against dataclass schemas.

A schema is a tree of dataclasses (OmegaConf structured configs). Sources merge in one stated
order, **command line > YAML file > dataclass defaults**. Sections (nested dataclasses) merge
key by key, but a dict- or list-valued *field* given in a source **replaces** the value below
it: ``reward: {fns: {gsm8k: 1.0}}`` means exactly ``{gsm8k: 1.0}``, never the default's keys
plus ``gsm8k``. An override names the key it replaces: ``reward.fns={gsm8k: 1.0}`` replaces the
dict, ``reward.fns.gsm8k=0.5`` sets one entry of it. Every problem (an unknown key, a
value of the wrong type, a required value left ``MISSING``, a broken ``${...}``
interpolation) is a ``ConfigError`` whose message names the full dotted key (``trainer.lr``),
what was expected there, and which source (file or override) brought the bad value.

Example::

    @dataclass
    class TrainerConfig:
        lr: float = 1e-5
        steps: int = MISSING

    @dataclass
    class AppConfig:
        trainer: TrainerConfig = field(default_factory=TrainerConfig)

    cfg = load_config(AppConfig, "configs/grpo_tiny.yaml", ["trainer.steps=100"])
    cfg.trainer.steps  # 100, an int
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from forge.describe import describe

T = TypeVar("T")

__all__ = ["ConfigError", "config_changes", "config_to_dict", "config_to_yaml", "load_config"]


class ConfigError(ValueError):
    """A configuration problem; ``key`` is the dotted path and ``source`` where it came from."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        super().__init__(message)
        self.key = key
        self.source = source


def load_config(schema_cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build a ``schema_cls`` instance from its defaults, then the YAML ``path``, then ``overrides``.

    ``overrides`` are ``dotted.key=value`` strings; the value is parsed as YAML (``3`` is an
    int, ``1e-4`` a float, ``[1,2]`` a list, ``null`` None). ``${other.key}`` interpolations are
    resolved in the returned object. Raises ``ConfigError`` on any unknown key, wrong type,
    missing required value or unresolvable interpolation. Cross-field checks in a schema's
    ``__post_init__`` run when the object is built and raise their own ``ValueError``
    (``ConfigError`` is one too, so ``except ValueError`` catches both).
    """
    if not (isinstance(schema_cls, type) and dataclasses.is_dataclass(schema_cls)):
        raise TypeError(f"schema_cls must be a dataclass type, got {schema_cls!r}")
    cfg = OmegaConf.structured(schema_cls)

    if path is not None:
        source = f"file {path}"
        cfg = _merge_checked(cfg, _load_yaml(Path(path)), schema_cls, source)

    for item in overrides:
        source = f"override {item!r}"
        layer = _parse_override(item, source)
        depth = len(item.partition("=")[0].strip().split("."))
        cfg = _merge_checked(cfg, layer, schema_cls, source, replace_depth=depth)

    try:
        return OmegaConf.to_object(cfg)  # resolves ${...}, fails on MISSING
    except oc_errors.OmegaConfBaseException as e:
        raise _translate(e, schema_cls, source="the merged config") from None


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, fully resolved ``dict`` of a config (dataclass instance, DictConfig or dict)."""
    node = cfg if isinstance(cfg, (DictConfig, ListConfig)) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML text: what a run logs so it can be reproduced."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def config_changes(cfg: Any) -> dict[str, Any]:
    """The parts of ``cfg`` (a dataclass instance) that differ from its schema's defaults.

    A nested ``dict`` holding only the changed leaves, so a run can print what it runs with
    beyond the defaults; a dict- or list-valued field that changed is shown whole.
    """
    defaults = OmegaConf.to_container(OmegaConf.structured(type(cfg)), resolve=False, enum_to_str=True)
    return _changed(config_to_dict(cfg), defaults, type(cfg))


def _changed(now: dict[str, Any], default: dict[str, Any], section: type) -> dict[str, Any]:
    """The leaves of ``now`` that differ from ``default``; ``section`` is their dataclass."""
    hints = typing.get_type_hints(section)
    out: dict[str, Any] = {}
    for key, value in now.items():
        was = default.get(key)
        kind = _unwrap_optional(hints.get(key))
        if isinstance(kind, type) and dataclasses.is_dataclass(kind) and isinstance(value, dict):
            sub = _changed(value, was if isinstance(was, dict) else {}, kind)
            if sub or not isinstance(was, dict):
                out[key] = sub or value
        elif value != was:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# Internals


def _load_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", source=f"file {path}")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}", source=f"file {path}") from None
    if isinstance(loaded, ListConfig):
        raise ConfigError(
            f"config file {path} must hold a mapping of keys at the top level, got a list",
            source=f"file {path}",
        )
    return loaded


def _parse_override(item: str, source: str) -> DictConfig:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad {source}: expected 'dotted.key=value'", source=source)
    try:
        return OmegaConf.from_dotlist([f"{key}={value}"])
    except oc_errors.OmegaConfBaseException as e:
        raise ConfigError(f"bad {source}: {_first_line(e)}", key=key, source=source) from None


def _merge_checked(
    cfg: DictConfig, layer: DictConfig, schema_cls: type, source: str, replace_depth: int | None = None
) -> DictConfig:
    """Merge ``layer`` over ``cfg``, turning OmegaConf's errors into ``ConfigError`` s.

    ``replace_depth``: an override's key depth; only a dict field named by the override's key
    itself is replaced (``reward.fns=...``), not one the key reaches into
    (``reward.fns.gsm8k=...``). None (a file): every dict field the layer gives is replaced.
    """
    _check_sections(cfg, layer, prefix="", source=source)
    try:
        merged = OmegaConf.merge(cfg, layer)
        _replace_dict_fields(merged, layer, depth=1, replace_depth=replace_depth)
        _mark_missing(merged, layer)
        return merged
    except oc_errors.OmegaConfBaseException as e:
        raise _translate(e, schema_cls, source) from None


def _replace_dict_fields(merged: DictConfig, layer: DictConfig, depth: int, replace_depth: int | None) -> None:
    """Make every dict-valued field of ``layer`` replace, not extend, the value below it.

    OmegaConf merges dicts key by key, which is right for sections (dataclasses) and wrong for
    a field whose value *is* a dict: ``reward.fns: {gsm8k: 1.0}`` would run with the default
    ``toy`` reward as well. Lists already replace. The merge has checked the types; assigning
    the layer's dict checks them again against the field's declared value type.
    """
    for key in layer.keys():
        incoming = layer._get_node(key)
        target = merged._get_node(key)
        if not (OmegaConf.is_dict(incoming) and OmegaConf.is_dict(target)):
            continue
        if incoming._is_none() or incoming._is_missing() or target._is_none() or target._is_missing():
            continue
        if OmegaConf.get_type(target) is dict:  # a dict-valued field, not a section
            if replace_depth is None or depth == replace_depth:
                merged[key] = OmegaConf.to_container(incoming, resolve=False)
        else:
            _replace_dict_fields(target, incoming, depth + 1, replace_depth)


def _mark_missing(cfg: DictConfig, layer: DictConfig) -> None:
    """Make every ``???`` of ``layer`` required in ``cfg``.

    OmegaConf's merge keeps the old value where the incoming one is ``???``, so a YAML file
    could not mark a field required (e.g. ``model.path: ???`` in a GPU config) where the
    schema has a default; a config that says "you must set this" should mean it.
    """
    for key in layer.keys():
        node = layer._get_node(key)
        if OmegaConf.is_dict(node) and not node._is_none() and not node._is_missing():
            target = cfg._get_node(key)
            if OmegaConf.is_dict(target) and not target._is_none():
                _mark_missing(target, node)
        elif OmegaConf.is_missing(layer, key):
            cfg[key] = "???"


def _check_sections(cfg: DictConfig, layer: DictConfig, prefix: str, source: str) -> None:
    """Reject a scalar or list given where the schema has a section (a nested dataclass).

    OmegaConf reports that case without the key ("int is not a subclass of X"), so it is
    checked here first, walking both trees together.
    """
    for key in layer.keys():
        key = str(key)
        full_key = f"{prefix}{key}"
        if key not in cfg:
            continue  # unknown keys are reported by OmegaConf with their full path
        target = cfg._get_node(key)
        incoming = layer._get_node(key)
        if target._is_none() or target._is_missing() or incoming._is_none() or incoming._is_missing():
            continue  # an optional section set or unset as a whole: OmegaConf checks it
        if OmegaConf.is_dict(target) and OmegaConf.get_type(target) not in (dict, None):
            if not OmegaConf.is_dict(incoming):
                if OmegaConf.is_list(incoming):
                    value = OmegaConf.to_container(incoming)
                else:
                    value = incoming._value()
                section = OmegaConf.get_type(target).__name__
                raise ConfigError(
                    f"{full_key}: expected a section of {section} fields "
                    f"({', '.join(map(str, target.keys()))}), got {value!r} (from {source})",
                    key=full_key,
                    source=source,
                )
            _check_sections(target, incoming, prefix=f"{full_key}.", source=source)


def _translate(e: oc_errors.OmegaConfBaseException, schema_cls: type, source: str) -> ConfigError:
    key = getattr(e, "full_key", None) or "<root>"
    detail = _first_line(e)
    expected = _expected_type(schema_cls, key)
    if isinstance(e, oc_errors.MissingMandatoryValue):
        what = f" ({expected})" if expected else ""
        message = f"{key}: missing required value{what}; set it in the YAML file or with {key}=..."
    elif isinstance(e, (oc_errors.ConfigKeyError, oc_errors.ConfigAttributeError)):
        parent, _, leaf = key.rpartition(".")
        known = _known_keys(schema_cls, parent)
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"; did you mean {'.'.join(filter(None, [parent, close[0]]))!r}?" if close else ""
        message = (
            f"{key}: unknown key (from {source}); known keys"
            f"{' under ' + repr(parent) if parent else ''}: {', '.join(known)}{hint}"
        )
    elif isinstance(e, oc_errors.InterpolationResolutionError):
        message = f"{key}: cannot resolve interpolation: {detail}"
        if expected:
            message += f" (expected {expected})"
    elif isinstance(e, oc_errors.ValidationError):
        message = f"{key}: {detail} (expected {expected or 'a valid value'}; from {source})"
    else:
        message = f"{key}: {detail} (from {source})"
    return ConfigError(message, key=key, source=source)


def _first_line(e: BaseException) -> str:
    """An OmegaConf error's own message (``str(e)`` adds lines that repeat the key and types)."""
    return describe(getattr(e, "msg", None) or e)


def _schema_at(schema_cls: type, dotted: str) -> Any:
    """The annotated type at ``dotted`` in the schema, or ``None`` where it cannot be followed."""
    node: Any = schema_cls
    for part in [p for p in dotted.split(".") if p]:
        part = part.split("[", 1)[0]
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = _unwrap_optional(hints[part])
    return node


def _unwrap_optional(hint: Any) -> Any:
    """``X | None`` (or ``Optional[X]``) -> ``X``; any other hint unchanged."""
    args = typing.get_args(hint)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _expected_type(schema_cls: type, dotted: str) -> str | None:
    if dotted == "<root>":
        return None
    hint = _schema_at(schema_cls, dotted)
    if hint is None:
        return None
    if isinstance(hint, type):
        if dataclasses.is_dataclass(hint):
            return f"a {hint.__name__} section"
        return hint.__name__
    return str(hint).replace("typing.", "")


def _known_keys(schema_cls: type, parent: str) -> list[str]:
    node = _schema_at(schema_cls, parent) if parent else schema_cls
    if isinstance(node, type) and dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    return []
