"""Mixture-of-experts token movement: capacity dispatch / combine, expert parallelism over `expert`, and a
dropless grouped-matmul path.

**Capacity path** (`moe_capacity`). Routing groups are sequence rows, never anything the mesh decides:
each row may send at most C = ceil(capacity_factor * T * k / E) tokens to each expert (`capacity`;
capacity_factor 0: C = T, which no row can exceed, since a token picks k distinct experts: dropless).
Slots are filled choice-major: every token's first choice, in token order, then every second choice, and
so on (GShard's priority: a top-1 choice is never dropped in favour of another token's top-2). An
assignment past C is dropped (its gate contributes nothing; the residual stream carries the token). A row
is whole on one rank (batch over data / fsdp / expert; the stream gathered over `tensor`) or split over
`seq`, where one all-gather of per-chunk counts gives each rank the row positions of its assignments
(`seq_offsets`): the same assignments are dropped on every mesh.

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
`jax.lax.ragged_dot` (one grouped matmul per projection, groups = experts). On one expert rank the
capacity path runs here too (`cap`): the same assignments kept and dropped, the dropped ones sorted past
every group. Dense slots would hold [E, B, C, D] dispatch and expert buffers (cf * k * B * T rows of
which the empty slots are computed too) and their gradients; grouped matmuls hold the kept rows only (Mixtral
8x7B at fsdp 64 on the TPU compiler: 32.97 -> see docs/moe.md).

**Ragged across expert ranks** (`moe_ragged_ep`): the sorted assignments are already grouped by
destination rank, so one `jax.lax.ragged_all_to_all` sends each rank exactly its experts' rows (no
padding on the wire); a [ep, ep] all-gather of the per-rank counts gives every offset. Each rank receives
into a static buffer, the senders' rows packed sender-major: by default ep * B*T*k rows (all assignments of
every rank could choose this rank's experts: dropless), or `moe.ep_buffer` balanced shares, past which a
sender's rows are dropped. With several experts per rank a local sort makes the rows expert-major; the
experts run over windows of about B*T*k rows one after another, and the outputs go back the same way.
With `moe.dispatch_chunks` the rank's rows go through all of it in groups, one after another (a
rematerialised scan): every buffer is sized for one group, so dropless (`ep_buffer` 0) costs what a
bounded buffer did.
XLA:CPU does not implement `ragged_all_to_all`, so the model's config check rejects
it there (use the capacity path with capacity_factor 0); the tests run this function on CPU with
`ragged_all_to_all_by_all_to_all`, an exact emulation of the primitive's semantics (padded all-to-alls),
and compile it with the real primitive for a TPU slice.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from parallax import compat

AXIS = "expert"
GROUPED_IMPLS = ("auto", "ragged_dot", "megablox")
MEGABLOX_TILES = (512, 1024, 1024)  # (m, k, n) tile bounds: MaxText's defaults for its megablox path


def grouped_impl(impl: str, platform: str | None) -> str:
    """`moe.grouped_impl` for the target: auto is megablox on TPU, else `jax.lax.ragged_dot`."""
    if impl == "auto":
        return "megablox" if (platform or jax.default_backend()) == "tpu" else "ragged_dot"
    return impl


def grouped_matmul(xs, w, sizes, impl: str = "ragged_dot", platform: str | None = None, full: bool = False):
    """Rows of xs [M, K] grouped by `sizes` [G] (contiguous, in group order; rows past the sum are padding)
    times their group's w [G, K, N] -> [M, N] in xs's dtype.

    `ragged_dot`: XLA's lowering of `jax.lax.ragged_dot` (any backend). `megablox`: the Pallas grouped
    matmul of JAX's TPU ops (what MaxText's dropless MoE calls), with its own VJP (a gmm for the input's
    gradient, a transposed gmm for the weights'); off TPU in Pallas interpret mode (the tests' CPU path).
    Its m tile must divide M: the rows are padded to a multiple of it (zeros, past every group) and cut
    off again. The kernel leaves the rows past the groups unwritten, in its output and in its input's
    gradient, so both are masked to 0 there (a select XLA fuses). `full`: the caller guarantees the groups
    cover every row (sum(sizes) == M, as in `moe_ragged`), so there is nothing to mask; the masks' selects
    are copies of [M, D] and [M, F] buffers the TPU compiler keeps beside the originals. Inside a manual
    region the kernel goes through `compat.kernel_call` (its outputs carry no varying-axes types)."""
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(xs, w, sizes)
    if impl != "megablox":
        raise ValueError(f"grouped matmul {impl!r}: expected ragged_dot or megablox")
    from jax.experimental.pallas.ops.tpu.megablox import ops

    m, k = xs.shape
    n = w.shape[2]
    tm = min(MEGABLOX_TILES[0], -(-m // 8) * 8)
    # One k / n tile for both (the kernel's VJP reuses the tiling with k and n swapped), a multiple of 128
    # as Mosaic needs unless it is a whole dim (tiny shapes); the last tile may be partial.
    tkn = min(MEGABLOX_TILES[1], k, n)
    tkn = tkn // 128 * 128 if tkn >= 128 else tkn
    tiles = (tm, tkn, tkn)
    pad = -m % tm
    interpret = (platform or jax.default_backend()) != "tpu"

    def gmm(xs, w, sizes):
        if pad:
            xs = jnp.concatenate([xs, jnp.zeros((pad, k), xs.dtype)])
        return ops.gmm(xs, w, sizes, xs.dtype, tiles, None, None, False, interpret)[:m]

    sizes = sizes.astype(jnp.int32)
    if full:
        return compat.kernel_call(gmm, xs, w, sizes)
    valid = (jnp.arange(m) < jnp.sum(sizes))[:, None]
    out = compat.kernel_call(gmm, jnp.where(valid, xs, jnp.zeros((), xs.dtype)), w, sizes)
    return jnp.where(valid, out, jnp.zeros((), out.dtype))


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert and row: ceil(factor * T * k / E), at most T; factor 0 -> T (drops nothing)."""
    if factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * k / num_experts)))


def slots(expert_idx, num_experts: int, cap: int, offset=None):
    """Each assignment's slot in its row's [E * C'] buffer, choice-major, C' = min(C, T) slots per expert.
    expert_idx [B, T, k] (distinct per token) -> (slot [B, T, k] in [0, E*C'), E*C' where dropped; keep
    [B, T, k] bool; load [B, E] assignments per expert before dropping).

    `offset` [B, T, k] (rows split over `seq`, `seq_offsets`): the row's assignments to the same expert
    that precede each one but are held by other ranks. An assignment is kept when its position in the
    whole row (local position + offset) is under C; the kept ones are a prefix of this rank's assignments
    to their expert (the row position grows with the local one), so the local position is the slot, and T
    local tokens fill at most T slots per expert."""
    b, t, k = expert_idx.shape
    order = expert_idx.transpose(0, 2, 1).reshape(b, k * t)  # choice-major: all first choices first
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)  # (B, k*T, E)
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # (B, k*T): index within expert
    position = position.reshape(b, k, t).transpose(0, 2, 1)  # (B, T, k)
    keep = (position if offset is None else position + offset) < cap
    c = min(cap, t)
    slot = jnp.where(keep, expert_idx * c + position, num_experts * c)
    return slot, keep, jnp.sum(onehot, axis=1)


def seq_offsets(expert_idx, num_experts: int, order, axis_name: str = "seq"):
    """Capacity routing with each row split over `seq` ranks (inside the manual region): for each of this
    rank's assignments expert_idx [B, T/s, k], how many of the row's assignments to the same expert come
    before it in the choice-major order of `slots` but are held by other ranks ([B, T/s, k] int32).

    `order` is the row's layout over the s ranks (`Parallelism.piece_order`: the row cut into n equal
    pieces, rank r holding pieces order[r*m : (r+1)*m], m = n/s; e.g. zigzag, usp, or range(s) for a row
    split in order). Each rank counts its assignments per piece, choice and expert; one all-gather over
    `seq` of those [B, m, k, E] counts gives every rank the counts before each of its pieces in row order,
    so `slots` keeps and drops exactly what it does on one device."""
    b, t, k = expert_idx.shape
    n = len(order)
    m = n // jax.lax.axis_size(axis_name)
    onehot = jax.nn.one_hot(expert_idx, num_experts, dtype=jnp.int32)  # (B, T/s, k, E)
    counts = jnp.sum(onehot.reshape(b, m, t // m, k, num_experts), axis=2)  # (B, m, k, E)
    every = jax.lax.all_gather(counts, axis_name)  # (s, B, m, k, E): layout order
    every = jnp.moveaxis(every, 2, 1).reshape(n, b, k, num_experts)  # (n, B, k, E): piece order[i] at i
    pieces = every[jnp.asarray([order.index(c) for c in range(n)])]  # (n, B, k, E): row order
    before_piece = jnp.cumsum(pieces, axis=0) - pieces  # (n, B, k, E)
    r = jax.lax.axis_index(axis_name)
    mine = jnp.asarray(order, jnp.int32)[r * m + jnp.arange(m)]  # (m,): my pieces' places in the row
    before_mine = jnp.moveaxis(before_piece[mine], 0, 1)  # (B, m, k, E): the row's, before my pieces
    total, local = jnp.sum(pieces, axis=0), jnp.sum(counts, axis=1)  # (B, k, E)
    before_choice = (jnp.cumsum(total, axis=1) - total) - (jnp.cumsum(local, axis=1) - local)  # (B, k, E)
    before_local = jnp.cumsum(counts, axis=1) - counts  # my earlier pieces' (counted in the local position)
    extra = before_choice[:, None] + before_mine - before_local  # (B, m, k, E)
    extra = jnp.repeat(extra, t // m, axis=1)  # (B, T/s, k, E)
    return jnp.sum(onehot * extra, axis=-1)


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


def moe_capacity(h, expert_idx, gates, num_experts: int, cap: int, experts_fn, ep: int = 1, chunks: int = 1,
                 offset=None):
    """The routed experts' output [B, T, D] for tokens h [B, T, D] by capacity dispatch.

    `experts_fn(x [E/ep, G, C, D]) -> [E/ep, G, C, D]` applies this rank's experts. With ep > 1 (inside the
    manual region) the slots travel to the experts' ranks and back with one all-to-all each way over
    `expert`, per chunk of `chunks` row groups (B must divide by it). `offset`: rows split over `seq`
    (`slots`); the buffers then hold min(C, T) slots per expert. Returns (output, keep [B, T, k],
    load [B, E])."""
    slot, keep, load = slots(expert_idx, num_experts, cap, offset)
    cap = min(cap, h.shape[1])

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


def ragged_all_to_all_by_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                    axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics with dense all-to-alls (every slice padded to the operand's
    length): for tests on backends without the primitive (XLA:CPU), never a silent fallback."""
    n, rest = operand.shape[0], operand.shape[1:]
    r = jnp.arange(n)
    valid = r[None, :] < send_sizes[:, None]  # [ep, n]
    chunks = operand[jnp.clip(input_offsets[:, None] + r[None, :], 0, n - 1)]  # [ep, n, ...]
    chunks = jnp.where(valid.reshape(*valid.shape, *(1,) * len(rest)), chunks, 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [ep senders, n, ...]
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # sender i's rows start here
    pos = jnp.where(r[None, :] < recv_sizes[:, None], where[:, None] + r[None, :], output.shape[0])
    return output.at[pos.reshape(-1)].set(got.reshape(-1, *rest), mode="drop")


def moe_ragged_ep(h, expert_idx, gates, num_experts: int, grouped_fn, ep: int,
                  exchange=jax.lax.ragged_all_to_all, buffer: float = 0.0, chunks: int = 1):
    """`_moe_ragged_ep` over `chunks` row groups of this rank's B rows (`moe.dispatch_chunks`), one after
    another in a rematerialised `lax.scan`: every buffer of the dispatch (sorted rows, receive buffer,
    returned rows, the experts' windows) is sized for one group and exists for one group at a time,
    forward and backward. With `buffer` 0 the result is exactly one pass's (dropless either way); with
    `buffer` f each group's receive buffer holds f balanced shares of the group, so what drops is decided
    per group. The price: each group's forward, all-to-alls included, runs again in the backward (up to 1.5x
    the all-to-all bytes of an unchunked step without remat), in 2 * chunks smaller exchanges each way. The
    weights' gradient is summed over the groups in their (compute) dtype, as over the windows."""
    b = h.shape[0]
    if chunks <= 1:
        return _moe_ragged_ep(h, expert_idx, gates, num_experts, grouped_fn, ep, exchange, buffer)
    if b % chunks:
        raise ValueError(f"moe.dispatch_chunks={chunks} does not divide this rank's {b} rows per microbatch; "
                         f"use a divisor of {b}")

    @jax.checkpoint
    def group(h, idx, gates):
        return _moe_ragged_ep(h, idx, gates, num_experts, grouped_fn, ep, exchange, buffer)

    def step(carry, args):
        return carry, group(*args)

    def split(a):
        return a.reshape(chunks, b // chunks, *a.shape[1:])
    _, outs = jax.lax.scan(step, None, (split(h), split(expert_idx), split(gates)))
    return tuple(a.reshape(b, *a.shape[2:]) for a in outs)


def _moe_ragged_ep(h, expert_idx, gates, num_experts: int, grouped_fn, ep: int, exchange, buffer: float):
    """The routed experts' output [B, T, D] across `ep` expert ranks (inside the manual region):
    `grouped_fn(xs [M, D], group_sizes [E/ep]) -> [M, D]` runs this rank's experts on rows grouped by
    local expert (rows past the groups' total are padding). Returns (output, keep [B, T, k], load [B, E]).

    Each rank receives into a static buffer of R rows, the senders' rows packed sender-major, each sender's
    grouped by this rank's experts. `buffer` 0 (dropless): R = ep * n, n = B*T*k (every assignment of every
    rank could choose this rank's experts). `buffer` f > 0 (`moe.ep_buffer`, MaxText's ragged buffer
    factor): R = ceil(f * n) (rounded up to equal windows), f times a rank's share in a balanced step; a
    sender sends a receiver only what still fits after the senders before it, and the rest of its rows for
    that receiver (the last of its last expert there) are dropped like capacity drops: output 0, `keep`
    False, counted in `dropped`. A full receiver takes the senders in rank order, so the drops fall on the
    higher-ranked senders' rows.

    With one expert per rank the packed rows are already grouped; with more, a local sort makes them
    expert-major. The experts run over ceil(R / n) equal windows of at most n rows one after another (a
    rematerialised scan, `_grouped_by_windows`): the grouped matmuls' [rows, F] intermediates exist for one
    window at a time."""
    b, t, k = expert_idx.shape
    d, n, el = h.shape[-1], b * t * k, num_experts // ep
    rows_cap = ep * n if buffer <= 0 else max(1, min(ep * n, math.ceil(buffer * n)))
    windows = -(-rows_cap // n)
    rows_cap = windows * -(-rows_cap // windows)  # equal windows of at most n rows
    flat = expert_idx.reshape(n)
    order = jnp.argsort(flat, stable=True)  # grouped by expert, hence by destination rank
    xs = h.reshape(b * t, d)[order // k]  # (N, D)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # (E,)
    me = jax.lax.axis_index(AXIS)
    want = jnp.sum(sizes.reshape(ep, el), axis=1)  # (ep,) rows for each rank
    wanted = jax.lax.all_gather(want, AXIS)  # (ep senders, ep receivers)
    before = jnp.cumsum(wanted, axis=0) - wanted  # rows of the senders before i, per receiver
    table = jnp.clip(rows_cap - before, 0, wanted)  # what fits: sender i -> receiver j
    send = table[me]  # (ep,)
    # Per expert, what survives of this sender's rows for each receiver (its slice is expert-ordered).
    per_rank = sizes.reshape(ep, el)
    cum = jnp.cumsum(per_rank, axis=1) - per_rank  # rows of the earlier local experts in the slice
    kept_sizes = jnp.clip(send[:, None] - cum, 0, per_rank)  # (ep, E/ep)
    slice_starts = jnp.cumsum(wanted, axis=1) - wanted  # [i, j]: sender i's slice for receiver j starts here
    dest_start = slice_starts[me]  # (ep,) in this rank's sorted rows
    pos = jnp.arange(n)
    dest = jnp.clip(jnp.searchsorted(jnp.cumsum(want), pos, side="right"), 0, ep - 1)  # (N,) receiver per row
    keep_sorted = pos - dest_start[dest] < send[dest]  # (N,) the head of each receiver's slice is sent
    recv = table[:, me]  # (ep,) rows from each sender
    # (what a sender sends is the head of its slice)
    # Offsets clamped into the buffers: a size-0 send (a sender past a full receiver) keeps a valid offset.
    buf = exchange(xs, jnp.zeros((rows_cap, d), xs.dtype), jnp.minimum(dest_start, n - 1), send,
                   jnp.minimum(before[me], rows_cap - 1), recv, axis_name=AXIS)
    counts = jax.lax.all_to_all(kept_sizes, AXIS, 0, 0, tiled=True)  # (ep senders, E/ep) as received
    group_sizes = jnp.sum(counts, axis=0).astype(jnp.int32)
    rows, total = jnp.arange(rows_cap), jnp.sum(recv)
    if el > 1:  # sender-major -> expert-major
        local = jnp.repeat(jnp.tile(jnp.arange(el), ep), counts.reshape(-1), total_repeat_length=rows_cap)
        perm = jnp.argsort(jnp.where(rows < total, local, el), stable=True)  # padding rows sort last
        ys = _grouped_by_windows(grouped_fn, buf[perm], group_sizes, windows)[jnp.argsort(perm)]
    else:
        ys = _grouped_by_windows(grouped_fn, buf, group_sizes, windows)
    ys = jnp.where((rows < total)[:, None], ys, 0)
    # Back: the rows from sender i (at `before` offsets here) return to where they came from.
    back = exchange(ys, jnp.zeros((n, d), ys.dtype), jnp.minimum(jnp.cumsum(recv) - recv, rows_cap - 1), recv,
                    jnp.minimum(slice_starts[:, me], n - 1), send, axis_name=AXIS)
    back = jnp.where(keep_sorted[:, None], back, 0)
    inverse = jnp.argsort(order)
    ys = back[inverse].reshape(b, t, k, d)
    keep = keep_sorted[inverse].reshape(b, t, k)
    load = jnp.sum(jax.nn.one_hot(expert_idx, num_experts, dtype=jnp.int32), axis=(1, 2))
    return jnp.einsum("btkd,btk->btd", ys, gates.astype(ys.dtype)), keep, load


def _grouped_by_windows(grouped_fn, xs, sizes, windows: int):
    """`grouped_fn(xs, sizes)` over `windows` equal row windows of xs [M, D] one after another (a
    rematerialised `lax.scan`), each with the part of every group that falls in it: the same rows out, and
    the grouped matmuls' [rows, F] intermediates exist for one window at a time. Windows past the real rows
    have empty groups (megablox visits no tile of them)."""
    m, d = xs.shape
    if windows <= 1 or m % windows:
        return grouped_fn(xs, sizes)
    w = m // windows
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    lo = jnp.arange(windows, dtype=jnp.int32)[:, None] * w
    parts = (jnp.clip(ends[None, :], lo, lo + w) - jnp.clip(starts[None, :], lo, lo + w)).astype(jnp.int32)

    @jax.checkpoint
    def window(x, s):
        return grouped_fn(x, s)

    def step(carry, args):
        return carry, window(*args)
    _, ys = jax.lax.scan(step, None, (xs.reshape(windows, w, d), parts))
    return ys.reshape(m, -1)


def moe_ragged(h, expert_idx, gates, num_experts: int, grouped_fn, cap: int | None = None, offset=None):
    """The routed experts' output [B, T, D] on one expert rank: assignments sorted by expert,
    `grouped_fn(xs [B*T*k, D], group_sizes [E]) -> [B*T*k, D]` runs the experts as grouped matmuls
    (`jax.lax.ragged_dot`). Dropless by default; with `cap` (capacity routing at mesh.expert 1) the
    assignments past their expert's C slots in a row (`slots`: the capacity path's choice-major rule) are
    sorted after every kept one, outside every group, so `grouped_fn` must zero rows past sum(sizes) (and its
    gradient flows to nothing there): the capacity path's result without its [E, B, C, D] slot buffers or the
    matmuls of empty slots. Returns (output, keep [B, T, k], load [B, E])."""
    b, t, k = expert_idx.shape
    flat = expert_idx.reshape(b * t * k)
    if cap is None:
        keep = jnp.ones(expert_idx.shape, bool)
        load = jnp.sum(jax.nn.one_hot(expert_idx, num_experts, dtype=jnp.int32), axis=(1, 2))
        key = flat
    else:
        _, keep, load = slots(expert_idx, num_experts, cap, offset)  # offset: rows split over `seq`
        key = jnp.where(keep.reshape(-1), flat, num_experts)  # dropped: one group past the last expert
    order = jnp.argsort(key, stable=True)  # assignments grouped by expert
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    xs = h.reshape(b * t, -1)[order // k]  # (B*T*k, D)
    ys = grouped_fn(xs, sizes)[jnp.argsort(order)].reshape(b, t, k, -1)  # back in assignment order
    if cap is not None:
        gates = jnp.where(keep, gates, jnp.zeros((), gates.dtype))
    return jnp.einsum("btkd,btk->btd", ys, gates.astype(ys.dtype)), keep, load
