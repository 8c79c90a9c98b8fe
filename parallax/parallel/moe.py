"""The routed experts of a mixture-of-experts layer, as the library runs them: `routed_experts` (a model
calls it through `par.experts`) and the checks of the dispatch settings (`check_dispatch`).

A MoE model owns its routing (the router, the gates, the aux losses) and its weights; it hands this module
the routed tokens, the expert choices and gates, and its experts' SwiGLU weights, and gets back the
experts' output. What happens between is the library's: which dispatch runs (capacity slots with
all-to-alls over `expert`, dropless grouped matmuls on one expert rank, the ragged all-to-all across expert
ranks), the per-batch-shard region the dropless sort needs under the compiler's sharding, where a row split
over `seq` places its assignments, and the row groups of `moe.dispatch_chunks`. The token movement itself
is `parallax.parallel.expert`. A second MoE family calls the same point; nothing of this is copied into
model code.

The experts are SwiGLU MLPs (`silu(x Wg) * (x Wu)` then `Wd`), weights `wg, wu [E, D, F]`, `wd [E, F, D]`
as `par.weight` gives them (the `experts` dim split over `expert`, `mlp` over `tensor`): what Mixtral,
DeepSeek-V3 and Qwen-MoE use. Another expert MLP would add its function here.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from parallax import compat, sharding
from parallax.errors import ConfigError
from parallax.parallel import expert as ep_lib
from parallax.parallel.manual import log_once
from parallax.parallel.region import vary

DISPATCH = ("capacity", "ragged")


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """How routed tokens reach their experts: the dispatch keys of a MoE model's `moe` section."""
    num_experts: int
    top_k: int
    dispatch: str  # capacity | ragged
    capacity_factor: float
    grouped_impl: str
    ff_chunks: int
    ep_buffer: float
    dispatch_chunks: int

    @classmethod
    def of(cls, section) -> "Dispatch":
        """From a section holding these keys (e.g. `config.model.moe`)."""
        return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})


def routed_experts(par, h, idx, gates, ws, names, d: Dispatch):
    """The routed experts' output for this rank's tokens: h [B, T, D] (T: this rank's part of each row under
    `seq`), idx / gates [B, T, k] -> (y [B, T, D] (partial sums over `tensor`), keep mask [B, T, k], load
    [B, E]). `ws` = (wg, wu, wd) in the compute dtype as `par.weight` gives them; `names` their logical
    names (one layer's). Dropless when `d.dispatch` is ragged, and when generating (`par.decoding`: every
    token routed) on one expert rank."""
    wg, wu, wd = ws
    dropless = d.dispatch == "ragged" or (par.decoding and par.expert == 1)
    row = h.shape[1] * par.seq  # a routing group is a whole row, split over `seq` in the region
    cap = ep_lib.capacity(row, d.top_k, d.num_experts, d.capacity_factor)
    cap = None if dropless or cap >= row else cap  # T slots: nothing can drop
    # A row split over `seq`: the row positions of this rank's assignments, so drops match one device.
    order = par.piece_order or tuple(range(par.seq))  # the row's layout over seq
    offset = ep_lib.seq_offsets(idx, d.num_experts, order) if cap and par.seq > 1 else None
    if dropless or par.expert == 1:
        impl = ep_lib.grouped_impl(d.grouped_impl, par.platform)
        log_once(f"grouped matmuls: {impl} (moe.grouped_impl={d.grouped_impl}), "
                     f"{d.ff_chunks} chunk(s) of the expert width")

        def grouped_with(gather, ws, full=False):  # full: the groups cover every row (no padding rows)
            def grouped(xs, sizes):  # (M, D) sorted by expert, sizes (E,)
                return _grouped_swiglu(xs, sizes, ws, gather, d.ff_chunks, lambda x, w: ep_lib.grouped_matmul(
                    x, w, sizes, impl, par.platform, full=full))
            return grouped
        if par.expert > 1:
            return ep_lib.moe_ragged_ep(h, idx, gates, d.num_experts, grouped_with(_whole, (wg, wu, wd)),
                                        par.expert, buffer=float(d.ep_buffer), chunks=d.dispatch_chunks)
        if offset is not None:  # inside the manual region: no per-shard split to make
            return ep_lib.moe_ragged(h, idx, gates, d.num_experts, grouped_with(_whole, (wg, wu, wd)), cap, offset)
        return _per_batch_shard(lambda gather, h, idx, gates, *ws: ep_lib.moe_ragged(
            h, idx, gates, d.num_experts, grouped_with(gather, ws, full=cap is None), cap), h, idx, gates,
            (wg, wu, wd), names)

    def experts(xe):  # (E/ep, G, C, D)
        act = jax.nn.silu(jnp.einsum("egcd,edf->egcf", xe, wg)) * jnp.einsum("egcd,edf->egcf", xe, wu)
        return jnp.einsum("egcf,efd->egcd", act, wd)
    cap = row if cap is None else cap
    return ep_lib.moe_capacity(h, idx, gates, d.num_experts, cap, experts, par.expert, d.dispatch_chunks, offset)


def check_dispatch(d, sizes: dict, config, platform: str) -> None:
    """The dispatch keys and expert widths of a MoE model's section `d` (`config.model.moe`: the `Dispatch`
    keys, `d_ff_expert`, `first_dense`, `dense_d_ff`) for mesh `sizes` on `platform` (the rows a rank
    dispatches at a time from `config`'s batch): raises ConfigError naming the key, the value and the fix."""
    seq_layout, global_batch_size = config.model.seq_layout, config.train.global_batch_size
    microbatches = config.pipeline.microbatches if sizes["pipe"] > 1 else config.train.microbatches
    if d.grouped_impl not in ep_lib.GROUPED_IMPLS:
        raise ConfigError(f"config.model.moe.grouped_impl={d.grouped_impl!r}: expected one of "
                          f"{', '.join(ep_lib.GROUPED_IMPLS)}")
    if d.dispatch not in DISPATCH:
        raise ConfigError(f"config.model.moe.dispatch={d.dispatch!r}: expected one of {', '.join(DISPATCH)}")
    ep, tp = sizes["expert"], sizes["tensor"]
    grouped = d.dispatch == "ragged" or ep == 1  # capacity on one expert rank runs grouped matmuls too
    where = f"(dispatch={d.dispatch!r}, mesh.expert={ep})"
    if d.grouped_impl != "auto" and not grouped:
        raise ConfigError(f"config.model.moe.grouped_impl={d.grouped_impl!r}: applies to the grouped matmuls "
                          f"of dispatch='ragged' or of mesh.expert=1 only {where}; set grouped_impl=auto")
    devices = math.prod(int(v) for v in sizes.values())
    if d.grouped_impl == "megablox" and (platform == "gpu" or (platform != "tpu" and devices > 1)):
        raise ConfigError(f"config.model.moe.grouped_impl='megablox' on {platform} with {devices} device(s): "
                          f"a TPU kernel; elsewhere it runs in Pallas interpret mode (for CPU tests, on one "
                          f"device only: not inside a shard_map); use grouped_impl=auto or ragged_dot")
    if d.first_dense and (d.dense_d_ff <= 0 or d.dense_d_ff % tp):
        raise ConfigError(f"config.model.moe.dense_d_ff={d.dense_d_ff}: first_dense={d.first_dense} dense "
                          f"layers need a positive MLP width divisible by mesh.tensor={tp}")
    if d.num_experts % ep:
        raise ConfigError(f"config.model.moe.num_experts={d.num_experts}: not divisible by mesh.expert={ep}; "
                          f"use an expert size that divides it")
    if d.d_ff_expert % tp:
        raise ConfigError(f"config.model.moe.d_ff_expert={d.d_ff_expert}: not divisible by mesh.tensor={tp}")
    if d.ep_buffer > 0 and not (d.dispatch == "ragged" and ep > 1):
        raise ConfigError(f"config.model.moe.ep_buffer={d.ep_buffer}: sizes the receive buffer of "
                          f"dispatch='ragged' across mesh.expert > 1 (here dispatch={d.dispatch!r}, "
                          f"expert={ep}); set ep_buffer=0")
    if 0 < d.ep_buffer < 1:
        raise ConfigError(f"config.model.moe.ep_buffer={d.ep_buffer}: under 1 drops assignments even when "
                          f"the load is balanced; use 0 (dropless) or >= 1 (e.g. 2)")
    if d.ff_chunks > 1:
        if not grouped:
            raise ConfigError(f"config.model.moe.ff_chunks={d.ff_chunks}: applies to the grouped matmuls of "
                              f"dispatch='ragged' or of mesh.expert=1 only {where}; set ff_chunks=1")
        if d.d_ff_expert % (tp * d.ff_chunks):
            raise ConfigError(f"config.model.moe.ff_chunks={d.ff_chunks}: d_ff_expert={d.d_ff_expert} / "
                              f"mesh.tensor={tp} is not divisible by it; use a divisor")
    if d.dispatch_chunks > 1:
        if ep == 1:
            raise ConfigError(f"config.model.moe.dispatch_chunks={d.dispatch_chunks}: chunks apply to the "
                              f"dispatch across mesh.expert > 1 only {where}; set dispatch_chunks=1")
        batch_ranks = sizes["data"] * sizes["fsdp"] * ep * sizes.get("replica", 1)  # DiLoCo replicas split it too
        rows = global_batch_size // max(1, microbatches * batch_ranks)
        if rows % d.dispatch_chunks:
            raise ConfigError(f"config.model.moe.dispatch_chunks={d.dispatch_chunks}: does not divide the "
                              f"{rows} rows per rank and microbatch (global_batch_size="
                              f"{global_batch_size} / {microbatches} microbatches / {batch_ranks} batch "
                              f"ranks); use a divisor of {rows}")
    if (sizes["seq"] > 1 and seq_layout == "balanced" and d.dispatch == "capacity"
            and d.capacity_factor > 0):
        raise ConfigError(f"config.model.moe.capacity_factor={d.capacity_factor} with model.seq_layout="
                          f"'balanced': capacity drops follow the row's token order, which the balanced layout "
                          f"scatters over the seq ranks; use capacity_factor=0 (dropless) or seq_layout=zigzag")
    if d.dispatch == "ragged" and ep > 1 and platform == "cpu":
        raise ConfigError(f"config.model.moe.dispatch='ragged' with mesh.expert={ep} on cpu: "
                          f"jax.lax.ragged_all_to_all is not implemented on XLA:CPU; use "
                          f"moe.dispatch='capacity' with moe.capacity_factor=0 (dropless: capacity = all tokens "
                          f"of a row), or mesh.expert=1")


def _whole(ws):
    return ws


def _grouped_swiglu(xs, sizes, ws, gather, chunks: int, mm):
    """The experts' SwiGLU on rows xs [M, D] grouped by expert: silu(xs Wg) * (xs Wu) then Wd, each `mm` a
    grouped matmul. `ws` = (wg [E, D, F], wu, wd [E, F, D]) as held (FSDP shards on the compiler-sharded
    path), `gather(ws)` the whole weights.

    `chunks` > 1 (`moe.ff_chunks`): the expert width F is cut into that many slices, run one after another
    in a `lax.scan` whose step gathers its slice of the three weights and is rematerialised: the output is
    the sum of the slices' (SwiGLU is a sum over F), and only one slice of the gathered weights, of their
    gradients and of the [M, F] intermediates is live at a time, forward and backward. The price is one
    more forward of the expert matmuls in the backward (more where an enclosing scan is rematerialised
    too, as the expert-parallel windows are). Inside the manual region `par.weight` has already gathered
    whole weights (`gather` is the identity): there only the intermediates shrink. The slices cut each
    rank's local F, and all three weights the same way, so any layout of F over the mesh gathers to the
    same permutation of F for all three (a SwiGLU does not depend on the order of its hidden units)."""
    def swiglu(wg, wu, wd):
        return mm(jax.nn.silu(mm(xs, wg)) * mm(xs, wu), wd)

    if chunks <= 1:
        return swiglu(*gather(ws))
    wg, wu, wd = ws
    f = wg.shape[2]
    if f % chunks:
        raise ValueError(f"moe.ff_chunks={chunks} does not divide this rank's expert width {f}; use a divisor")
    e, c = wg.shape[0], f // chunks

    def split_cols(w):  # [E, D, F] -> [chunks, E, D, F/chunks]
        return jnp.moveaxis(w.reshape(e, w.shape[1], chunks, c), 2, 0)
    slices = (split_cols(wg), split_cols(wu), jnp.moveaxis(wd.reshape(e, chunks, c, wd.shape[2]), 1, 0))

    @jax.checkpoint
    def part(w_slice):
        return swiglu(*gather(w_slice)).astype(jnp.float32)

    def step(acc, w_slice):
        return acc + part(w_slice), None
    # Every slice inside the loop, the sum starting from zeros typed as a slice's output (varying over the
    # axes xs, sizes and the weights vary over inside a shard_map): a first slice computed before the loop
    # kept its own gathered weights and [M, F] intermediates live beside the loop's, forward and backward.
    acc, _ = jax.lax.scan(step, _zeros_varying_like(xs.shape, jnp.float32, xs, sizes, *ws), slices)
    return acc.astype(xs.dtype)


def _zeros_varying_like(shape, dtype, *operands):
    """Zeros of `shape`, varying (inside a `shard_map`) over every manual axis one of `operands` varies
    over: the type of a value computed from them."""
    axes = frozenset().union(*(compat.varying_axes(a) for a in operands))
    return vary(jnp.zeros(shape, dtype), tuple(sorted(axes)))


def _per_batch_shard(fn, h, idx, gates, weights, names):
    """`fn(gather, h, idx, gates, *weights)` run per batch shard under the compiler's sharding (the dense
    path: no manual region): a `shard_map` over every mesh axis, the rows split over the batch axes, each
    weight entering with its own sharding (logical `names`) as `fn`'s local shard, and `gather(ws)` giving
    whole weights from shards (all-gathers inside, so a gradient leaves as a reduce-scatter (FSDP), not an
    all-reduce of the whole expert weights). `fn` gathers where it needs them (a slice at a time with
    `moe.ff_chunks`).

    Why: dropless routing sorts all of a shard's assignments by expert; left to GSPMD, the sort of the
    flattened [B*T*k] assignments cannot be partitioned, so every device sorted, gathered and ran the whole
    global batch's tokens (Mixtral 8x7B at fsdp 64 on v5p: 241 GiB of temporaries, 23 GiB with this).
    Outside a sharding context (one device, a manual region) it is `fn` with whole weights."""
    ctx = sharding.activation_context()
    if ctx is None:
        return fn(_whole, h, idx, gates, *weights)
    mesh, rules = ctx
    spec = sharding.logical_to_spec(("batch",), rules, mesh)
    if not len(spec) or spec[0] is None:
        return fn(_whole, h, idx, gates, *weights)
    rows = P(spec[0])
    batch_axes = set(sharding.spec_axes(spec[0]))
    w_specs = tuple(sharding.logical_to_spec(n, rules, mesh) for n in names)
    w_axes = [{a for e in s for a in sharding.spec_axes(e)} for s in w_specs]
    if any(not axes <= batch_axes for axes in w_axes):  # a weight split over a non-batch axis: left to GSPMD
        return fn(_whole, h, idx, gates, *weights)

    def gather(local):
        whole = []
        for w, w_spec, axes in zip(local, w_specs, w_axes):
            # Varying over the other batch axes *before* the gather: the backward then sums the shard's
            # gradient over them (a psum of 1/fsdp of the weight) and reduce-scatters, instead of all-reducing
            # the whole gathered gradient over `data`.
            extra = tuple(a for a in mesh.axis_names if a in batch_axes and a not in axes)
            w = vary(w, extra)
            for dim, entry in enumerate(w_spec):
                axes = sharding.spec_axes(entry)
                if axes:
                    w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
            whole.append(w)
        return tuple(whole)

    def per_shard(h, idx, gates, *local):
        return fn(gather, h, idx, gates, *local)

    region = jax.shard_map(per_shard, mesh=mesh, in_specs=(rows, rows, rows, *w_specs), out_specs=(rows, rows, rows))
    return region(h, idx, gates, *weights)
