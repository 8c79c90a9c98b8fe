"""Logical axis names and the rules table that maps them onto mesh axes.

Parameters carry logical names in their `logical` metadata (e.g. `('embed', 'mlp')`); activations are
constrained with `constrain(x, ('batch', 'length', 'act_embed'))`. One table, `DEFAULT_RULES`, maps each
logical name to a mesh axis, a tuple of mesh axes, or None (replicated). Parameter names and activation
names are kept apart (`embed` is a weight dimension sharded by FSDP; `act_embed` is the model dimension of
an activation, which FSDP leaves whole), following levanter's split of parameter and compute mappings.
The config's `sharding.rules` overrides entries of the table; model code never changes with the mesh.

Shapes first, then shardings, then allocation: `abstract_params` traces the init with `jax.eval_shape`,
`param_shardings` turns the logical names into `NamedSharding`s, and `init_sharded` jits the init with those
out_shardings so every parameter is created already sharded.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.errors import ConfigError
from parallax.mesh import AXES, REPLICA

DEFAULT_RULES: dict[str, object] = {
    # Parameters.
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": "pipe",  # stacked layers: each pipeline rank stores the layers of its own stages
    "experts": "expert",
    "norm": None,
    "lora_rank": None,  # LoRA adapters' rank dim (parallax/lora.py)
    # Activations.
    "batch": ("data", "fsdp", "expert"),
    "length": "seq",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}

_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("parallax_sharding", default=None)


def make_rules(overrides=None, extra=None) -> dict[str, object]:
    """DEFAULT_RULES plus a model's `extra` names, with `overrides` ({logical: mesh axis | tuple | None})
    applied; unknown names are errors."""
    rules = dict(DEFAULT_RULES)
    for name, value in dict(extra or {}).items():
        rules[name] = _mesh_axes(name, value)
    for name, value in dict(overrides or {}).items():
        if name not in rules:
            raise ConfigError(f"config.sharding.rules.{name}: unknown logical axis; valid: {', '.join(sorted(rules))}")
        rules[name] = _mesh_axes(name, value)
    return rules


def _mesh_axes(name, value):
    """Normalises a rule value to None, one mesh axis, or a tuple of mesh axes; rejects anything else."""
    if isinstance(value, str) and value.lower() in ("", "none"):
        return None
    # A str may list several axes, as the command line gives them: `--config.sharding.rules.embed=fsdp,seq`.
    axes = tuple(a.strip() for a in value.split(",")) if isinstance(value, str) else tuple(value or ())
    axes = tuple(a for a in axes if not (a is None or (isinstance(a, str) and a.lower() == "none")))
    for axis in axes:
        if axis == REPLICA:
            raise ConfigError(f"config.sharding.rules.{name}={value!r}: no rule may name the {REPLICA!r} axis "
                              f"(DiLoCo's replicas each hold a whole model); use None or the other mesh axes")
        if axis not in AXES:
            raise ConfigError(f"config.sharding.rules.{name}={value!r}: {axis!r} is not a mesh axis; use None or "
                              f"mesh axes from {', '.join(AXES)}")
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one rule value or PartitionSpec entry (None, an axis name, or a tuple of them)."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def logical_to_spec(names, rules, mesh=None, shape=None, what="array") -> P:
    """Maps logical names to a PartitionSpec. Mesh axes of size 1 are dropped; a mesh axis is used once.

    With `shape`, a dimension that the rules shard but that the mesh axes do not divide is a ConfigError.
    """
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        target = rules.get(name) if name is not None else None
        axes = spec_axes(target)
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
        axes = tuple(a for a in axes if a not in used)
        if shape is not None and axes and mesh is not None:
            ways = 1
            for a in axes:
                ways *= mesh.shape[a]
            if shape[dim] % ways:
                raise ConfigError(
                    f"{what}: dimension {dim} ({name}) has size {shape[dim]}, not divisible by mesh axes "
                    f"{axes} of size {ways}; change the model size or the mesh, or set config.sharding.rules.{name}")
        used.update(axes)
        spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def is_logical_names(x) -> bool:
    """A tuple of logical names (the leaves of a logical-names tree)."""
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def param_logical_names(abstract_state) -> dict:
    """Pure-dict pytree of the logical names of every parameter of an nnx state."""
    def names(var):
        meta = var.get_metadata()
        logical = meta.get("logical")
        value = var.get_value()
        if logical is None or len(logical) != value.ndim:
            raise ValueError(f"parameter of shape {value.shape} has logical names {logical}; annotate every dim")
        return tuple(logical)
    tree = jax.tree.map(names, abstract_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def param_shardings(abstract_params, logical_names, mesh, rules) -> dict:
    """NamedShardings for a pure-dict params tree, from its logical names."""
    def one(path, arr, names):
        where = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
        return NamedSharding(mesh, logical_to_spec(names, rules, mesh, arr.shape, where))
    return jax.tree_util.tree_map_with_path(one, abstract_params, logical_names, is_leaf=is_logical_names)


@contextlib.contextmanager
def activation_sharding(mesh, rules):
    """Within this context, `constrain` applies the rules on `mesh`; outside it, `constrain` is a no-op."""
    token = _CONTEXT.set((mesh, rules))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def activation_context():
    """(mesh, rules) of the enclosing `activation_sharding`, or None (outside one, e.g. in a manual region)."""
    return _CONTEXT.get()


def constrain(x, names):
    """Constrains activation `x` to the sharding its logical `names` map to (no-op without a context)."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules, mesh)))


def batch_sharding(mesh, rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length, ...] input array."""
    return NamedSharding(mesh, logical_to_spec(("batch", "length") + (None,) * (ndim - 2), rules, mesh))


# Logical names that explicit tensor / sequence / expert parallelism shards over its own axis.
_EXPLICIT_RULES = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
                   ("length", "seq"), ("experts", "expert"))


def model_rules(overrides, model_rules_, model_name: str) -> dict:
    """The rules table of a model that adds `model_rules_` (its class's `rules`) with the config's
    `sharding.rules` `overrides` applied; a model may only add names."""
    clash = set(model_rules_) & set(DEFAULT_RULES)
    if clash:
        raise ConfigError(f"config.model.name={model_name!r}: the model's `rules` redefine "
                          f"{sorted(clash)}; a model may only add logical names (change existing ones in "
                          f"config.sharding.rules)")
    return make_rules(dict(overrides), extra=model_rules_)


def check_explicit_rules(sizes, rules, logical) -> None:
    """Explicit tensor / sequence parallelism splits what the rules say: the logical names the model uses
    for heads, MLP and vocabulary must still map to `tensor`, and `length` to `seq`."""
    used = {n for names in jax.tree.leaves(logical, is_leaf=is_logical_names) for n in names} | {"length"}
    for name, axis in _EXPLICIT_RULES:
        if name in used and sizes[axis] > 1 and rules[name] != axis:
            raise ConfigError(f"config.sharding.rules.{name}={rules[name]!r}: mesh.{axis}={sizes[axis]} runs "
                              f"explicit {axis} parallelism, which needs {name} -> {axis!r}; restore that rule")


def check_params(model_name: str, num_layers: int, sizes, rules, abstract_params, logical) -> None:
    """Every parameter's logical names are in the rules and its sharded dims divide; `blocks` is a stack."""
    if "blocks" not in abstract_params:
        raise ConfigError(f"config.model.name={model_name!r}: the model has no `blocks` attribute (the stack of "
                          f"identical blocks that parallax scans and pipelines); see parallax.model")
    mesh = types.SimpleNamespace(shape=sizes)
    for path, names in jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_logical_names)[0]:
        where = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
        unknown = [n for n in names if n is not None and n not in rules]
        if unknown:
            raise ConfigError(f"config.model.name={model_name!r}: {where} uses logical name {unknown[0]!r}, which "
                              f"the rules table lacks; add it to the model's `rules` (valid: "
                              f"{', '.join(sorted(rules))})")
        leaf = abstract_params
        for key in path:
            leaf = leaf[key.key]
        logical_to_spec(names, rules, mesh, leaf.shape, where)  # raises ConfigError if it does not divide
        if path[0].key == "blocks" and (names[0] != "layers" or leaf.shape[0] != num_layers):
            raise ConfigError(f"config.model.name={model_name!r}: {where} has shape {leaf.shape} and names {names}; "
                              f"every block parameter needs a leading 'layers' dim of num_layers={num_layers}")
