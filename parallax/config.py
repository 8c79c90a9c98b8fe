"""Strict dotted overrides and the JSON form of a config.

Overrides on the command line (`--config.train.steps=10`) must name an existing key and parse to the key's
type; anything else is a `ConfigError` (`parallax/errors.py`), which the launcher turns into exit status 2 and
one line naming the key, the value and what would be valid. Semantic checks (mesh vs devices, batch vs data
parallelism, heads vs tensor) also raise `ConfigError`, before anything is compiled. Config files themselves,
which start from the model's defaults, are loaded by `parallax/defaults.py`. No jax here: the launchers parse
their overrides with this module before jax starts.
"""

from __future__ import annotations

import ast
import contextlib

import ml_collections

from parallax.errors import ConfigError


def _parse_value(key: str, text: str, current):
    """Parses `text` to the type of `current`, or raises ConfigError naming the expected type."""
    expected = type(current)
    if isinstance(current, bool):
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"config.{key}={text!r}: expected a bool (true or false)")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"config.{key}={text!r}: expected an int, e.g. config.{key}={current}") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"config.{key}={text!r}: expected a float, e.g. config.{key}={current}") from None
    if isinstance(current, str):
        return text
    if current is None:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    if isinstance(current, (tuple, list)):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = tuple(v.strip() for v in text.split(",") if v.strip())
        if not isinstance(value, (tuple, list)):
            value = (value,)
        return expected(value)
    raise ConfigError(f"config.{key}={text!r}: keys of type {expected.__name__} cannot be overridden from the command line")


# Keys renamed since configs were first saved: old dotted name -> new. The one place a rename is recorded:
# a saved `config.json` is migrated by it when loaded (`migrate`), and an override or config file that
# spells an old name is told the new one.
RENAMED = {
    # 2026-12 (settings redesign): each optimizer's keys are its own section, `optim.NAME`
    "optim.b1": "optim.adamw.b1", "optim.b2": "optim.adamw.b2", "optim.eps": "optim.adamw.eps",
    "optim.muon_beta": "optim.muon.beta", "optim.muon_nesterov": "optim.muon.nesterov",
    "optim.muon_ns_steps": "optim.muon.ns_steps", "optim.muon_scale": "optim.muon.scale",
    "optim.muon_rms": "optim.muon.rms", "optim.muon_exclude": "optim.muon.exclude",
    "optim.sgd_momentum": "optim.sgd.momentum",
}


def migrate(saved: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A saved config (`config_from_json`) with every key of `RENAMED` moved to its new name (a copy)."""
    out = ml_collections.ConfigDict(saved.to_dict())
    for old, new in RENAMED.items():
        *where, key = old.split(".")
        node = out
        for part in where:
            node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        if not isinstance(node, ml_collections.ConfigDict) or key not in node:
            continue
        value = node[key]
        del node[key]
        *path, name = new.split(".")
        target = out
        for part in path:
            if part not in target:
                target[part] = ml_collections.ConfigDict()
            target = target[part]
        target[name] = value
    return out


def apply_override(config: ml_collections.ConfigDict, key: str, text: str) -> None:
    """Sets `config.<key>` (dotted) from a command-line string, strictly."""
    if key in RENAMED:
        raise ConfigError(f"config.{key}: renamed to {RENAMED[key]}; pass --config.{RENAMED[key]}={text}")
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts):
        if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
            where = ".".join(parts[:i]) or "config"
            valid = sorted(node.keys()) if isinstance(node, (ml_collections.ConfigDict, dict)) else []
            raise ConfigError(f"config.{key}: unknown key {part!r} in {where}; valid keys: {', '.join(valid)}")
        if i < len(parts) - 1:
            node = node[part]
    current = node[parts[-1]]
    if isinstance(current, (ml_collections.ConfigDict, dict)):
        raise ConfigError(f"config.{key}: is a section, not a value; set one of its keys: {', '.join(sorted(current.keys()))}")
    with config.unlocked() if hasattr(config, "unlocked") else contextlib.nullcontext():
        node[parts[-1]] = _parse_value(key, text, current)


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Separates `--config.a.b=v` arguments from the rest of argv."""
    rest, overrides = [], []
    for arg in argv:
        if arg.startswith("--config."):
            body = arg[len("--config."):]
            if "=" not in body:
                raise ConfigError(f"{arg}: overrides need a value, e.g. --config.{body}=VALUE")
            key, value = body.split("=", 1)
            overrides.append((key, value))
        else:
            rest.append(arg)
    return rest, overrides


def config_from_json(text: str):
    """Rebuilds a ConfigDict saved with `to_json_best_effort` (lists become tuples)."""
    import json

    def fix(node):
        if isinstance(node, dict):
            return ml_collections.ConfigDict({k: fix(v) for k, v in node.items()})
        if isinstance(node, list):
            return tuple(node)
        return node
    return fix(json.loads(text))
