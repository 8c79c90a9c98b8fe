"""The complete default config, and the config files built on it.

Experiment files (`get_config()`) start from `default_config` and change only what differs; a run's saved
`config.json` is laid over today's defaults (`load_saved_config`). `load_config_file` / `config_from_args`
load either kind, strictly: a bad file or override is a one-line `ConfigError`. `config_source` writes a
resolved config back as a config file that spells out every key.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re
import traceback

import ml_collections

from parallax import diloco_settings, dpo_settings, lora, optim, quant, train_settings
from parallax import mesh as mesh_lib
from parallax.config import RENAMED, apply_override, config_from_json, migrate
from parallax.errors import ConfigError
from parallax.model import config_file_dir, model_class, model_config_defaults, resolve_model_name
from parallax.pipeline import settings as pipeline_settings
from parallax.sharding import make_rules


def default_config(model: str) -> ml_collections.ConfigDict:
    """Every key parallax reads, with its default, for model `model`: a registered name (an entry point
    of group `parallax.models`, e.g. `llama`), `package.module:Class`, or `path/to/file.py:Class`.
    `config.model` holds the generic model keys (`parallax.model.GENERIC_KEYS`) and the model's own (its
    `config_defaults()`). The dict is locked: setting a key not listed here (a typo such as
    `config.train.stpes = 5`) raises instead of adding a key nothing reads; so do overrides of such keys.
    A relative `file.py` is found next to the config file being loaded, else in the current directory, and
    `config.model.name` holds it absolute (`parallax.model.resolve_model_name`)."""
    model = resolve_model_name(model)
    c = ml_collections.ConfigDict()
    # Each section's keys are declared by the mechanism that reads them (`KEYS` in its module), each with its
    # meaning in a comment on its line: `parallax/configdoc.py` builds the page of config keys
    # (docs/config-keys.md) from them, and a test fails when a key has none.
    c.mesh = ml_collections.ConfigDict(mesh_lib.KEYS)
    c.dcn = ml_collections.ConfigDict(mesh_lib.DCN_KEYS)
    c.model = ml_collections.ConfigDict(model_config_defaults(model))
    c.train = ml_collections.ConfigDict(train_settings.KEYS)
    c.optim = ml_collections.ConfigDict(optim.KEYS)
    for name, cls in optim.OPTIMIZERS.items():  # each optimizer's own section: optim.adamw, optim.muon, ...
        c.optim[name] = ml_collections.ConfigDict(cls.KEYS)
    c.pipeline = ml_collections.ConfigDict(pipeline_settings.KEYS)
    c.diloco = ml_collections.ConfigDict(diloco_settings.KEYS)
    c.lora = ml_collections.ConfigDict(lora.KEYS)
    c.dpo = ml_collections.ConfigDict(dpo_settings.KEYS)
    c.quant = ml_collections.ConfigDict(quant.KEYS)
    c.data = ml_collections.ConfigDict(dict(
        source="synthetic",  # synthetic | text (bytes of files) | tokens (shard directories or one token file) | preference (DPO pairs, a .jsonl)
        path="",  # text: a directory ('': the Python stdlib); tokens: shard directories (comma-separated) or a file
        eval_fraction=0.05,  # the last fraction of the tokens, held out for eval
        eos_id=-1,  # end-of-document id between documents (-1: the tokenizer's)
        sampler="random",  # random (each row's window drawn from seed, step, row) | epoch (a seeded permutation)
        tokenizer="",  # '' (the corpus's: bytes for text, a shard directory's own), or a file / HF directory
        mixture="",  # 'NAME=WEIGHT,...' over the sources of the shard directories ('': no mixture)
    ))
    # Multi-process runs (parallax/distributed.py).
    c.dist = ml_collections.ConfigDict(dict(
        coordinator="",  # HOST:PORT of process 0 ('': detect, or a single process)
        num_processes=0,  # processes in the run, with a coordinator
        process_id=-1,  # this process's id, with a coordinator
        detect="auto",  # auto (Slurm, multi-host TPU) | jax (always ask JAX's cluster detection) | off
        heartbeat_timeout_s=100,  # a peer silent this long stops the others (exit 3)
        init_timeout_s=300,  # how long to wait for every process to join
    ))
    c.sharding = ml_collections.ConfigDict()
    c.sharding.rules = ml_collections.ConfigDict(make_rules(extra=model_class(model).rules))
    return c.lock()


def with_defaults(saved):
    """A saved config laid over today's `default_config` for its model: keys added since it was written
    (e.g. model.loss_chunk, optim.schedule) take their defaults, and keys renamed since (`config.RENAMED`)
    move to their new names, so it compares and loads as today's."""
    def overlay(base, over):
        for key, value in over.items():
            if isinstance(value, ml_collections.ConfigDict) and isinstance(base.get(key), ml_collections.ConfigDict):
                overlay(base[key], value)
            else:
                base[key] = value
    try:  # a relative file name, saved before names were stored absolute, is looked up from here
        config = default_config(saved.model.name)
    except ConfigError as e:
        module = saved.model.name.rpartition(":")[0]
        if not module.endswith(".py") or os.path.isabs(module):
            raise
        raise ConfigError(f"{e}; this name comes from a saved config (a workdir's config.json, written before model "
                          f"files were stored by absolute path): run from the directory that run was started in, "
                          f"or write the file's absolute path into that config.json") from None
    with config.unlocked():
        overlay(config, migrate(saved))
    config.model.name = resolve_model_name(config.model.name)  # the saved relative name, made absolute again
    return config


def load_saved_config(text: str) -> ml_collections.ConfigDict:
    """The config a run saved in its workdir (the text of its `config.json`) laid over today's defaults
    (`with_defaults`). Raises ValueError, KeyError, AttributeError or TypeError on text that is not one."""
    return with_defaults(config_from_json(text))


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Imports a config file and returns its `get_config()` (or, for a `.json` file, the config a run saved in
    its workdir, with today's defaults for keys added since). Anything the file raises (a syntax error, a key
    that the locked `default_config()` does not have, any exception) is a one-line ConfigError naming the
    file and line."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path}: no such file; pass a file such as configs/quickstart.py")
    if path.endswith(".json"):  # a run's own config.json (e.g. one launch/hf_import.py wrote)
        try:
            with open(path) as f:
                return load_saved_config(f.read())
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ConfigError(f"--config={path}: not a parallax config.json ({type(e).__name__}: {e}); pass the "
                              "config.json a run wrote, or a Python config file") from None
    name = "parallax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        with config_file_dir(os.path.dirname(os.path.abspath(path))):  # its model file is found next to it
            spec.loader.exec_module(module)
            if not hasattr(module, "get_config"):
                raise ConfigError(f"--config={path}: the file defines no get_config(); add one returning a "
                                  "ConfigDict")
            config = module.get_config()
            if "model" in config and "name" in config.model:  # e.g. set after default_config(): absolute too
                config.model.name = resolve_model_name(config.model.name)
            return config
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
        renamed = [new for old, new in RENAMED.items() if old.rsplit(".", 1)[1] == key]
        if renamed:
            return f"--config={where}: unknown key {key!r}{code}; it was renamed to {renamed[0]}"
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


def config_from_args(path: str, overrides: list[tuple[str, str]]):
    """Loads a config file and applies the dotted overrides, strictly (a relative `model.name` file given as
    an override is relative to the current directory, and stored absolute)."""
    config = load_config_file(path)
    for key, value in overrides:
        apply_override(config, key, value)
    if "model" in config and "name" in config.model:
        config.model.name = resolve_model_name(config.model.name)
    return config


def _literal(value) -> str:
    """Python source for a config value: `repr`, except non-finite floats (`float('inf')`), also inside
    tuples, lists and dicts."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_literal, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(map(_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def config_source(config: ml_collections.ConfigDict, command: str = "") -> str:
    """`config` as the text of a config file whose `get_config()` returns it: `default_config` of its model,
    then every key of every section set to its value, defaults included (`launch/train.py --print_config`).
    `command`: what produced it, for the docstring."""
    lines = ['"""A resolved config, every key spelled out. Train with it:', "",
             "    python launch/train.py --config=THIS_FILE --workdir=DIR", '"""', "",
             *([f"# printed by: {command}".replace("\n", "\\n").replace("\r", "\\r"), ""] if command else []),
             "from parallax.defaults import default_config", "", "", "def get_config():",
             f"    config = default_config(model={config.model.name!r})"]

    base = default_config(config.model.name)

    def section(path, node, default):
        leaves = {k: v for k, v in node.items() if not isinstance(v, ml_collections.ConfigDict)}
        retyped = {}  # keys whose value ConfigDict would refuse in place: another type than the default's
        for key, value in leaves.items():
            try:
                default[key] = value
            except (TypeError, AttributeError, KeyError):
                retyped[key] = value
        leaves = {k: v for k, v in leaves.items() if k not in retyped}
        if leaves:
            named = all(k.isidentifier() for k in leaves)
            items = [f"{k}={_literal(v)}" if named else f"{k!r}: {_literal(v)}" for k, v in leaves.items()]
            lines.append(f"    config.{path}.update({'' if named else '{'}")
            for item in items:  # as many as fit in 120 columns on each line
                if lines[-1].endswith(("(", "{")) or len(lines[-1]) + len(item) + 4 > 120:  # ", " now, "," or ")" after
                    lines[-1] += "" if lines[-1].endswith(("(", "{")) else ","
                    lines.append("        " + item)
                else:
                    lines[-1] += ", " + item
            lines[-1] += ")" if named else "})"
        if retyped:
            lines.append(f"    with config.{path}.unlocked():  # values of another type than the default's")
            for key, value in retyped.items():
                if key in default:
                    lines.append(f"        del config.{path}[{key!r}]")
                lines.append(f"        config.{path}[{key!r}] = {_literal(value)}")
        for key, value in node.items():
            if isinstance(value, ml_collections.ConfigDict):
                section(f"{path}.{key}", value, default[key] if key in default else ml_collections.ConfigDict())
    for key, value in config.items():
        section(key, value, base[key])
    lines.append("    return config")
    return "\n".join(lines) + "\n"
