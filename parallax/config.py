"""Config handling: strict dotted overrides and config errors.

Configs are Python files with `get_config() -> ml_collections.ConfigDict`. Overrides on the command line
(`--config.train.steps=10`) must name an existing key and parse to the key's type; anything else is a
`ConfigError`, which the launcher turns into exit status 2 and one line naming the key, the value and what
would be valid. Semantic checks (mesh vs devices, batch vs data parallelism, heads vs tensor) also raise
`ConfigError`, before anything is compiled.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import os
import re
import traceback

import ml_collections


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming key, value and the fix."""


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Imports a config file and returns its `get_config()` (or, for a `.json` file, the config a run saved in
    its workdir, with today's defaults for keys added since). Anything the file raises (a syntax error, a key
    that the locked `default_config()` does not have, any exception) is a one-line ConfigError naming the
    file and line."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path}: no such file; pass a file such as configs/quickstart.py")
    if path.endswith(".json"):  # a run's own config.json (e.g. one launch/hf_import.py wrote)
        from parallax.defaults import with_defaults
        try:
            with open(path) as f:
                return with_defaults(config_from_json(f.read()))
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ConfigError(f"--config={path}: not a parallax config.json ({type(e).__name__}: {e}); pass the "
                              "config.json a run wrote, or a Python config file") from None
    name = "parallax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"--config={path}: the file defines no get_config(); add one returning a ConfigDict")
        return module.get_config()
    except ConfigError:
        raise
    except SyntaxError as e:  # also IndentationError
        raise ConfigError(f"--config={path}:{e.lineno}: {type(e).__name__}: {e.msg}; fix that line") from None
    except Exception as e:  # noqa: BLE001 -- anything the user's file raises becomes one line naming it
        raise ConfigError(_describe_config_file_error(path, e)) from None


_LOCKED_KEY = re.compile(r'Key "([^"]+)" does not exist and cannot be added since the config is locked')


def _describe_config_file_error(path: str, error: Exception) -> str:
    """One line for an exception raised while running a config file: the file's line that raised it, and
    for a key the (locked) default config does not have, the closest valid keys of that section."""
    frames = traceback.extract_tb(error.__traceback__)
    lines = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
    where = f"{path}:{lines[-1].lineno}" if lines else path
    code = f" ({lines[-1].line.strip()})" if lines and lines[-1].line else ""
    unknown = _LOCKED_KEY.search(str(error))
    if unknown:
        key, section = unknown.group(1), _raising_config_dict(error.__traceback__)
        valid = sorted(section.keys()) if section is not None else []
        close = difflib.get_close_matches(key, valid, n=3) or valid
        return (f"--config={where}: unknown key {key!r}{code}; close valid keys: {', '.join(close)} (configs "
                f"start from default_config(), which holds every key; a model's own come from its config_defaults())")
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"--config={where}: {type(error).__name__}: {message}{code}; fix the config file"


def _raising_config_dict(tb):
    """The locked ConfigDict that refused a new key (the innermost ConfigDict method's `self`), or None."""
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, ml_collections.ConfigDict):
            found = candidate
        tb = tb.tb_next
    return found


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


def apply_override(config: ml_collections.ConfigDict, key: str, text: str) -> None:
    """Sets `config.<key>` (dotted) from a command-line string, strictly."""
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


def config_from_args(path: str, overrides: list[tuple[str, str]]):
    """Loads a config file and applies the dotted overrides, strictly."""
    config = load_config_file(path)
    for key, value in overrides:
        apply_override(config, key, value)
    return config


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
