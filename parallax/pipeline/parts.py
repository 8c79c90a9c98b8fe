"""The model's parts as a pipeline runs them, traced once on abstract values: `Parts`.

A pipeline runs the embedding on its first stage, the blocks in chunks and the head and loss on its last
stage; what each part reads (parameters, and whether the layers return aux values) is decided once, by
abstract traces of the single-device code (a model reads the same parameters and batch keys under every
layout). The plan makes them (`make_plan`, which checks the pipeline settings against them:
`pipeline.settings.check_parts`) and keeps them on the plan; the pipelined step path, the layout search's
FLOP counts (`flops`) and the memory report's per-rank balance read them.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import model as model_lib
from parallax.compat import dce_jaxpr
from parallax.parallel.manual import DENSE
from parallax.pipeline.work import dot_flops


class Parts(NamedTuple):
    """A one-row microbatch of zeros, the non-block parameters, the stacked blocks (all abstract), the
    blocks' graphdef, `model(rest)`: the model on those, `x`: the residual stream's shape after `embed`,
    and what the parts read: `first_keys` / `last_keys` (flat paths of the non-block leaves `embed` /
    `loss` read), `stage_aux` (the layers return aux values)."""
    mb: dict
    rest: dict
    blocks: dict
    graphdef: object
    model: Callable
    x: jax.ShapeDtypeStruct
    first_keys: frozenset
    last_keys: frozenset
    stage_aux: bool

    @classmethod
    def make(cls, plan) -> "Parts":
        rest = {k: v for k, v in plan.abstract_params.items() if k != "blocks"}
        blocks = plan.abstract_params["blocks"]
        graphdef = nnx.split(nnx.merge(plan.graphdef, plan.abstract_params).blocks)[0]
        # A one-row batch of zeros shaped like the training batch (to trace what a stage reads).
        mb = jax.tree.map(lambda a: jnp.zeros((1, *a.shape[1:]), a.dtype), plan.abstract_batch())

        def model(p):
            return nnx.merge(plan.graphdef, {**p, "blocks": blocks})
        x = jax.eval_shape(lambda p: model(p).embed(mb, DENSE), rest)
        x0 = jnp.zeros(x.shape, x.dtype)
        first = leaves_read(lambda p: model(p).embed(mb, DENSE), rest)
        last = leaves_read(lambda p: model(p).loss(x0, mb, DENSE), rest)
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), blocks)  # one layer, stacked
        stage_aux = bool(jax.eval_shape(lambda c, x: model_lib.apply_blocks_aux(graphdef, c, x, mb)[1], one, x))
        return cls(mb, rest, blocks, graphdef, model, x, first, last, stage_aux)

    def x0(self):
        return jnp.zeros(self.x.shape, self.x.dtype)

    def one_layer(self) -> dict:
        """One layer's abstract block parameters (the stack's leading dim dropped)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.blocks)

    def flops(self, remat: str) -> dict:
        """Forward matmul FLOPs of one sequence (`pipeline.work.dot_flops` of the dense code's jaxpr) through
        the embedding, one layer, and the head and loss: what `pipeline.layout='auto'` balances."""
        def count(fn, *args):
            return float(dot_flops(jax.make_jaxpr(fn)(*args).jaxpr))
        model, mb = self.model, self.mb
        return {"embed": count(lambda p: model(p).embed(mb, DENSE), self.rest),
                "layer": count(lambda w, x: model_lib.apply_layer_aux(self.graphdef, w, x, mb, remat, DENSE),
                               self.one_layer(), self.x),
                "loss": count(lambda p, x: model(p).loss(x, mb, DENSE), self.rest, self.x)}


def paths(tree) -> list:
    """The flat paths of a tree's leaves (`jax.tree_util.keystr`), in leaf order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def leaves_read(fn, tree) -> frozenset:
    """Paths of the leaves of `tree` that `fn(tree)` reads: the inputs of its jaxpr that any equation or
    output uses (traced with the dense code; a model reads the same parameters under every layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    closed = jax.make_jaxpr(lambda *xs: fn(jax.tree.unflatten(treedef, xs)))(*leaves)
    used = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars} | {id(v) for v in closed.jaxpr.outvars}
    return frozenset(path for path, var in zip(paths(tree), closed.jaxpr.invars) if id(var) in used)


def leaves_live(fn, tree) -> frozenset:
    """Paths of the leaves of `tree` that `fn(tree)`'s value depends on: `leaves_read` after dead-code
    elimination, so that an input only reshaped or padded along the way (the chunked loss splits every
    batch key into chunks, and reads only some) does not count."""
    leaves, treedef = jax.tree.flatten(tree)
    closed = jax.make_jaxpr(lambda *xs: fn(jax.tree.unflatten(treedef, xs)))(*leaves)
    _, live = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return frozenset(path for path, used in zip(paths(tree), live) if used)
