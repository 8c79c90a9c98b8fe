"""The page of every config key (docs/config-keys.md): section, key, default, type and meaning.

    python -m parallax.configdoc > docs/config-keys.md

The meanings are the comments beside the defaults: each section's home (`KEYS` in the module of the
mechanism that reads it: `HOMES`; each optimizer's in its class), `parallax/defaults.py` (`default_config`:
data, dist), `parallax/model.py` (`GENERIC_KEYS`) and each registered model's module (its `config_defaults()`). A key
without one is an error here, and `tests/test_config.py` fails when the checked-in page differs from what
this prints, so the page stays current.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import re
import sys
import textwrap

import ml_collections

from parallax import defaults, diloco_settings, dpo_settings, lora, model, optim, quant, train_settings
from parallax import mesh as mesh_lib
from parallax.pipeline import settings as pipeline_settings
from parallax.sharding import DEFAULT_RULES

# `key=value,  # meaning` or `"key": value,  # meaning`: one key per line, its meaning in the comment
_KEY_LINE = re.compile(r'^\s*"?(\w+)"?\s*[=:]\s*.*?#\s*(.+)$')
_SECTION_LINE = re.compile(r"^\s*c\.(\w+) = ml_collections\.ConfigDict\(")


def _comments(source: str, sectioned: bool = False) -> dict:
    """{key: meaning} of the key lines in `source` ({(section, key): meaning} with `sectioned`: the section
    of `default_config`'s `c.SECTION = ...` line above it)."""
    found, section = {}, None
    for line in source.splitlines():
        start = _SECTION_LINE.match(line)
        if start:
            section = start.group(1)
        match = _KEY_LINE.match(line)
        if match:
            found.setdefault((section, match.group(1)) if sectioned else match.group(1), match.group(2).strip())
    return found


def _keys_source(owner, name: str = "KEYS") -> str:
    """The source of the `KEYS = dict(...)` statement (or another `name`'s) of a module or class: a section's
    declaration."""
    source = textwrap.dedent(inspect.getsource(owner))
    body = ast.parse(source).body
    if isinstance(owner, type):
        body = body[0].body
    node = next(n for n in body if isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == [name])
    return "\n".join(source.splitlines()[node.lineno - 1:node.end_lineno])


# Each section's home: where its keys are declared (`KEYS`) with their meanings; None: `default_config` itself.
# A (module, name) pair: the section is declared as `name` there (`config.dcn`: `DCN_KEYS` beside the mesh's).
HOMES = {"mesh": mesh_lib, "dcn": (mesh_lib, "DCN_KEYS"), "train": train_settings, "optim": optim, "pipeline": pipeline_settings,
         "diloco": diloco_settings, "lora": lora, "dpo": dpo_settings, "quant": quant, "data": None, "dist": None}


def _rows(section: str, node, meaning) -> list[tuple]:
    """(dotted key, default, type, meaning) per leaf of `node`; `meaning(key)` or a ValueError."""
    rows = []
    for key, value in node.items():
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            continue
        text = meaning(key)
        if not text:
            raise ValueError(f"config.{section}.{key}: no comment beside its default; add `# what it means` on its "
                             "line (parallax/configdoc.py reads them)")
        rows.append((f"{section}.{key}", value, type(value).__name__, text))
    return rows


def _table(title: str, intro: str, rows: list[tuple]) -> list[str]:
    lines = [f"## {title}", ""] + ([intro, ""] if intro else [])
    lines += ["| key | default | type | meaning |", "|---|---|---|---|"]
    for key, value, kind, text in rows:
        lines.append(f"| `{key}` | `{value!r}` | {kind} | {text.replace(' | ', ' / ').replace('|', '/')} |")
    return lines + [""]


def _model_comments(cls, others) -> dict:
    """{key: meaning} for a model: from its `config_defaults()`, then the other registered models' (a model
    may take another's defaults, as the MoE model takes Llama's: those its module imports first), then
    anywhere in their modules (e.g. a nested section's dict)."""
    imported = set(map(id, vars(inspect.getmodule(cls)).values()))  # the models its module imports come first
    others = sorted(others, key=lambda c: id(inspect.getmodule(c)) not in imported)
    sources = [inspect.getsource(c.config_defaults) for c in (cls, *others)]
    sources += [inspect.getsource(inspect.getmodule(c)) for c in (cls, *others)]
    found = {}
    for source in sources:
        found = {**_comments(source), **found}
    return found


def config_keys_page() -> str:
    """The markdown page of every config key."""
    base = defaults.default_config("llama")
    general = _comments(inspect.getsource(defaults.default_config), sectioned=True)
    generic = _comments(inspect.getsource(model))
    lines = ["# Config keys", "",
             "Every key parallax reads, with its default, its type and what it means; set any of them with",
             "`--config.SECTION.KEY=VALUE` or in a config file ([Config files and overrides](configs.md)).",
             "`launch/train.py --config=FILE --print_config` prints a config with every key spelled out.", "",
             "This page is generated from the comments beside the defaults (each section's `KEYS` in the "
             "module that reads it,",
             "`parallax/defaults.py`, `GENERIC_KEYS` in `parallax/model.py`, each model's `config_defaults()`):",
             "`python -m parallax.configdoc > docs/config-keys.md`;",
             "a test fails when it is out of date.", ""]
    for section, home in HOMES.items():
        home = home if isinstance(home, tuple) else (home, "KEYS")
        comments = (_comments(_keys_source(*home)) if home[0] else
                    {k: v for (s, k), v in general.items() if s == section})
        lines += _table(section, "", _rows(section, base[section], comments.get))
        if section == "optim":  # each optimizer's own section
            for name, cls in optim.OPTIMIZERS.items():
                lines += _table(f"optim.{name}", f"Read with `optim.name={name}`" + (
                    " (and by Muon, for the parameters it leaves to AdamW)." if name == "adamw" else "."),
                    _rows(f"optim.{name}", base.optim[name], _comments(_keys_source(cls)).get))
    lines += _table("model", "Read by parallax for every model; `model.name` picks the model, whose own keys "
                    "follow.", _rows("model", model.GENERIC_KEYS, generic.get))
    registered = {ep.name: ep.load() for ep in importlib.metadata.entry_points(group=model.ENTRY_POINT_GROUP)}
    for name, cls in sorted(registered.items()):
        own = {k: v for k, v in cls.config_defaults().items() if k not in model.GENERIC_KEYS}
        comments = _model_comments(cls, [c for n, c in sorted(registered.items()) if n != name])
        rows = _rows("model", own, comments.get)
        for key, value in own.items():
            if isinstance(value, dict):
                rows += _rows(f"model.{key}", value, comments.get)
        lines += _table(f"model: {name}", f"`model.name={name}` (`{cls.__module__}:{cls.__name__}`) adds:", rows)
    rules = [(f"sharding.rules.{k}", v, type(v).__name__, f"mesh axes of the logical name `{k}`") for k, v in
             DEFAULT_RULES.items()]
    lines += _table("sharding.rules", "Logical axis name -> a mesh axis, a tuple of them, or None (replicated); a "
                    "model may add names ([Parallelism](parallelism.md#changing-the-parallelism)).", rules)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(config_keys_page())
