"""Command-line flags generated from config dataclasses, so each setting is declared once: as a field
(name, type, default) whose metadata holds its help. `add_flags` turns the fields into argparse flags,
`config_from_args` reads them back into the config. A new setting is one new field."""
from __future__ import annotations

import argparse
import dataclasses
import enum
import typing
from typing import Any, Callable, Mapping

_KEY = "pdserve.setting"
# Marks a field whose value is a settings dataclass of its own (see settings_group()).
_GROUP = object()
_UNION_TYPE = type(int | None)


@dataclasses.dataclass(frozen=True)
class _Setting:
    help: str
    flag: str | None  # None: --field-name
    parse: Callable[[Any], Any] | None  # flag value -> field value (None: the field's type does it)
    argparse_options: Mapping[str, Any]  # extra add_argument options (e.g. action="append")


def setting(
    help: str, *, flag: str | None = None, parse: Callable[[Any], Any] | None = None, **argparse_options: Any
) -> dict[str, Any]:
    """Field metadata that makes a field a flag: `field(default=..., metadata=setting("help"))`.
    flag "--no-x" on a bool field that defaults to True makes a switch that turns it off."""
    return {_KEY: _Setting(help, flag, parse, argparse_options)}


def engine_settings(**helps: str | dict[str, Any]) -> dict[str, Any]:
    """Metadata for a field holding an engine config (which declares no flags itself): the inner
    fields named here become flags, each with a help (or a setting()); the field's default_factory
    gives the defaults."""
    return {_KEY: dict(helps)}


def settings_group() -> dict[str, Any]:
    """Metadata for a field holding another config whose own fields declare settings: its flags are
    added (and read back) with the outer config's; the field's default_factory gives the defaults."""
    return {_KEY: _GROUP}


def _inner_setting(help_or_setting: str | dict[str, Any]) -> _Setting:
    if isinstance(help_or_setting, str):
        return _Setting(help_or_setting, None, None, {})
    return help_or_setting[_KEY]


def add_flags(
    parser: argparse.ArgumentParser, config_class: type, *, exclude: tuple[str, ...] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per setting field of config_class (and of the engine configs it holds), except the
    fields named in exclude. defaults: a service's own default for a field (its port), over the field's."""
    for field, hint in _setting_fields(config_class):
        if field.name in exclude:
            continue
        spec = field.metadata[_KEY]
        if spec is _GROUP:
            add_flags(parser, type(field.default_factory()))
        elif isinstance(spec, dict):
            inner_default = field.default_factory()
            inner_hints = typing.get_type_hints(type(inner_default))
            for name, help_or_setting in spec.items():
                inner_spec = _inner_setting(help_or_setting)
                _add_flag(parser, name, inner_hints[name], getattr(inner_default, name), inner_spec)
        else:
            default = field.default if field.default is not dataclasses.MISSING else None
            _add_flag(parser, field.name, hint, (defaults or {}).get(field.name, default), spec)


def config_from_args(config_class: type, args: argparse.Namespace, **overrides: Any):
    """The config built from parsed flags; fields without a flag in args keep their defaults, and
    overrides win over both."""
    values: dict[str, Any] = {}
    for field, hint in _setting_fields(config_class):
        spec = field.metadata[_KEY]
        if spec is _GROUP:
            values[field.name] = config_from_args(type(field.default_factory()), args)
        elif isinstance(spec, dict):
            inner = {name: getattr(args, name) for name in spec if hasattr(args, name)}
            values[field.name] = dataclasses.replace(field.default_factory(), **inner)
        elif hasattr(args, field.name):
            values[field.name] = _field_value(getattr(args, field.name), hint, spec)
    return config_class(**{**values, **overrides})


def _setting_fields(config_class: type):
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if _KEY in field.metadata:
            yield field, hints[field.name]


def _add_flag(parser: argparse.ArgumentParser, name: str, hint: Any, default: Any, spec: _Setting) -> None:
    flag = spec.flag or "--" + name.replace("_", "-")
    value_type = _value_type(hint)
    options: dict[str, Any] = {"dest": name, "help": _help(spec.help, default)}
    if value_type is bool:
        options["action"] = "store_false" if flag.startswith("--no-") else "store_true"
        options["default"] = default
    elif isinstance(value_type, type) and issubclass(value_type, enum.Enum):
        options["choices"] = [member.value for member in value_type]
        options["default"] = default.value if default is not None else None
    else:
        options["default"] = default
        options["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        if spec.parse is None:
            options["type"] = value_type
    options.update(spec.argparse_options)
    parser.add_argument(flag, **options)


def _field_value(value: Any, hint: Any, spec: _Setting) -> Any:
    if spec.parse is not None:
        return spec.parse(value)
    value_type = _value_type(hint)
    if value is not None and isinstance(value_type, type) and issubclass(value_type, enum.Enum):
        return value_type(value)
    return value


def _value_type(hint: Any) -> Any:
    """int for `int | None`, the class itself otherwise."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) in (typing.Union, _UNION_TYPE) and len(args) == 1:
        return args[0]
    return hint


def _help(text: str, default: Any) -> str:
    if default is None or default == "" or isinstance(default, bool):
        return text
    # argparse fills in the flag's default; a parser with ArgumentDefaultsHelpFormatter then adds no second one.
    return f"{text} (default %(default)s)"
