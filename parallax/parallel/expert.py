"""Mixture-of-experts token movement: capacity dispatch / combine, expert parallelism over `expert`, and a
dropless grouped-matmul path.

**Capacity path** (`moe_capacity`). Routing groups are sequence rows, never anything the mesh decides:
each row may send at most C = ceil(capacity_factor * T * k / E) tokens to each expert (`capacity`;
capacity_factor 0: C = T, which no row can exceed, since a token picks k distinct experts: dropless).
Slots are filled choice-major: every token's first choice, in token order, then every second choice, and
so on (GShard's priority: a top-1 choice is never dropped in favour of another token's top-2). An
assignment past C is dropped (its gate contributes nothing; the residual stream carries the token). Since
a row is whole on one rank (batch over data / fsdp / expert; the stream gathered over `tensor`), the same
assignments are dropped on every mesh.

Shapes: B rows on this rank, T tokens per row, D d_model, E experts, k choices per token, C slots per
expert and row, ep = mesh.expert, G = ep * B.

    dispatch:   h [B, T, D] -> [E, B, C, D]   (a gather of token rows into the slots; empty slots are 0)
    all-to-all: [E, B, C, D] -> [E/ep, G, C, D]   (expert block j to expert rank j; rows from every rank)
    experts:    each rank applies its E/ep experts to G*C slots each
    all-to-all: [E/ep, G, C, D] -> [E, B, C, D]   (results back to the rows' ranks)
    combine:    y[b, t] = sum_i gate[b, t, i] * slots[expert_i, b, pos_i]   (dropped: 0)

Per layer and direction each rank sends and receives 2 * E * B * C * D * bytes (two all-to-alls, of
which (ep-1)/ep leaves the rank); the backward repeats both (the transposes of all-to-alls are
all-to-alls). Expert weights never move: rank j holds experts [j E/ep, (j+1) E/ep).

**Chunked dispatch** (`chunks` > 1, `moe.dispatch_chunks`): this rank's rows are cut into `chunks` groups
that go through dispatch, all-to-all, experts, all-to-all and combine one after another, unrolled, so the
compiler can run one chunk's all-to-all while the previous chunk's expert matmuls run (async collectives
on GPU / TPU; COMET / FUSCO overlap). Capacity is per row, so the chunks compute exactly what one pass
does (any backend); each all-to-all carries 1/chunks of the bytes, 2 * chunks of them each way.

**Ragged path** (`moe_ragged`, dropless, one expert rank): assignments sorted by expert and run through
`jax.lax.ragged_dot` (one grouped matmul per projection, groups = experts). Between expert ranks it would
need `jax.lax.ragged_all_to_all`, which XLA:CPU does not implement; the model's config check rejects
it (use the capacity path with capacity_factor 0 there).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

AXIS = "expert"


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert and row: ceil(factor * T * k / E), at most T; factor 0 -> T (drops nothing)."""
    if factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * k / num_experts)))


def slots(expert_idx, num_experts: int, cap: int):
    """Each assignment's slot in its row's [E * C] buffer, choice-major. expert_idx [B, T, k] (distinct per
    token) -> (slot [B, T, k] in [0, E*C), E*C where dropped; keep [B, T, k] bool; load [B, E] assignments
    per expert before dropping)."""
    b, t, k = expert_idx.shape
    order = expert_idx.transpose(0, 2, 1).reshape(b, k * t)  # choice-major: all first choices first
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)  # (B, k*T, E)
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # (B, k*T): index within expert
    position = position.reshape(b, k, t).transpose(0, 2, 1)  # (B, T, k)
    keep = position < cap
    slot = jnp.where(keep, expert_idx * cap + position, num_experts * cap)
    return slot, keep, jnp.sum(onehot, axis=1)


def dispatch(h, slot, num_experts: int, cap: int):
    """Token rows into expert slots: h [B, T, D], slot [B, T, k] -> [E, B, C, D] (empty slots zero)."""
    b, t, k = slot.shape
    token = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :, None], slot.shape)
    source = jnp.full((b, num_experts * cap + 1), t, jnp.int32)  # row t of the padded h is zeros
    source = source.at[jnp.arange(b)[:, None], slot.reshape(b, t * k)].set(token.reshape(b, t * k))
    padded = jnp.concatenate([h, jnp.zeros((b, 1, h.shape[-1]), h.dtype)], axis=1)  # (B, T+1, D)
    x = jnp.take_along_axis(padded, source[:, :num_experts * cap, None], axis=1)  # (B, E*C, D)
    return x.reshape(b, num_experts, cap, -1).transpose(1, 0, 2, 3)


def combine(y, slot, gates):
    """Expert outputs back to tokens: y [E, B, C, D], slot and gates [B, T, k] -> [B, T, D]."""
    e, b, c, d = y.shape
    flat = jnp.concatenate([y.transpose(1, 0, 2, 3).reshape(b, e * c, d), jnp.zeros((b, 1, d), y.dtype)], axis=1)
    t, k = slot.shape[1:]
    picked = jnp.take_along_axis(flat, slot.reshape(b, t * k, 1), axis=1).reshape(b, t, k, d)  # (B, T, k, D)
    return jnp.einsum("btkd,btk->btd", picked, gates.astype(y.dtype))


def moe_capacity(h, expert_idx, gates, num_experts: int, cap: int, experts_fn, ep: int = 1, chunks: int = 1):
    """The routed experts' output [B, T, D] for tokens h [B, T, D] by capacity dispatch.

    `experts_fn(x [E/ep, G, C, D]) -> [E/ep, G, C, D]` applies this rank's experts. With ep > 1 (inside the
    manual region) the slots travel to the experts' ranks and back with one all-to-all each way over
    `expert`, per chunk of `chunks` row groups (B must divide by it). Returns (output, keep [B, T, k],
    load [B, E])."""
    slot, keep, load = slots(expert_idx, num_experts, cap)

    def one(h, slot, gates):
        x = dispatch(h, slot, num_experts, cap)  # (E, B, C, D)
        if ep > 1:
            x = jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=1, tiled=True)  # (E/ep, G, C, D)
        y = experts_fn(x)
        if ep > 1:
            y = jax.lax.all_to_all(y, AXIS, split_axis=1, concat_axis=0, tiled=True)  # (E, B, C, D)
        return combine(y, slot, gates)

    b = h.shape[0]
    if chunks <= 1:
        return one(h, slot, gates), keep, load
    if b % chunks:
        raise ValueError(f"moe.dispatch_chunks={chunks} does not divide this rank's {b} rows per microbatch; "
                         f"use a divisor of {b}")
    n = b // chunks
    parts = [one(h[i * n:(i + 1) * n], slot[i * n:(i + 1) * n], gates[i * n:(i + 1) * n]) for i in range(chunks)]
    return jnp.concatenate(parts, axis=0), keep, load


def moe_ragged(h, expert_idx, gates, num_experts: int, grouped_fn):
    """The routed experts' output [B, T, D], dropless, on one expert rank: assignments sorted by expert,
    `grouped_fn(xs [B*T*k, D], group_sizes [E]) -> [B*T*k, D]` runs the experts as grouped matmuls
    (`jax.lax.ragged_dot`). Returns (output, keep (all True), load [B, E])."""
    b, t, k = expert_idx.shape
    flat = expert_idx.reshape(b * t * k)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = h.reshape(b * t, -1)[order // k]  # (B*T*k, D)
    ys = grouped_fn(xs, sizes)[jnp.argsort(order)].reshape(b, t, k, -1)  # back in assignment order
    load = jnp.sum(jax.nn.one_hot(expert_idx, num_experts, dtype=jnp.int32), axis=(1, 2))
    return jnp.einsum("btkd,btk->btd", ys, gates.astype(ys.dtype)), jnp.ones(expert_idx.shape, bool), load
