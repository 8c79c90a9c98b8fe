"""The pipeline executor: runs a schedule table as one `lax.scan` over ticks inside a `jax.shard_map`.

`compile_schedule` lowers a `Schedule` (numpy, ahead of time) into per-tick, per-rank integer
instructions: which switch branch to run, on which microbatch / local chunk / activation slot, which
inbox entry holds its input, and into which inbox entries the messages that arrive this tick go.
`pipeline_value_and_grad` runs those instructions: every tick each rank `lax.switch`es on its branch,
then two fixed `ppermute`s (+1 ring "up", -1 ring "down", only the pairs the schedule uses) move the
tick's outputs to the neighbour ranks. `to_pipeline_layout` / `from_pipeline_layout` move stacked layer
weights `[L, ...]` to the executor's `[p, v, L / (p * v), ...]` layout and back.

Axis names: `pipe` (ranks), and the batch axes (`data`, `fsdp` by default) over which microbatch rows
are split.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from parallax.pipeline.schedule import B, BW, F, IDLE, W, Schedule

# Branches of the per-tick switch. `_FIRST` variants hold stage 0 (they also run `first_fn` or its
# pullback); `_F_LAST` holds the last stage (it also runs `last_fn` and its pullback, which seeds the
# backward).
_IDLE, _F, _F_FIRST, _F_LAST, _B, _B_FIRST, _W, _BW, _BW_FIRST = range(9)

# Fields of one lowered instruction. Inbox indices are -1 where nothing is read or written.
_BRANCH, _MB, _CHUNK, _SLOT, _IN, _LOCAL, _FROM_UP, _FROM_DOWN = range(8)
_NUM_FIELDS = 8


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A schedule lowered for the executor.

    code: int32 [ticks, p, 8] instructions (fields `_BRANCH` .. `_FROM_DOWN`); `code[..., _BRANCH]`
      indexes `branches`, the switch branches this schedule uses.
    inbox_size: entries of the per-rank inbox that buffers activations and output cotangents from their
      arrival until their last use (bounded by the schedule, not by the number of microbatches for
      1F1B-like schedules).
    num_slots: per-rank activation slots (residuals, or chunk inputs with remat).
    up_perm / down_perm: `ppermute` pairs for messages to rank r+1 / r-1 (mod p); empty if unused.
    """
    code: np.ndarray
    branches: tuple[int, ...]
    inbox_size: int
    num_slots: int
    up_perm: tuple[tuple[int, int], ...]
    down_perm: tuple[tuple[int, int], ...]

    @property
    def num_ticks(self) -> int:
        return int(self.code.shape[0])


def compile_schedule(schedule: Schedule) -> Program:
    """Lowers `schedule` into executor instructions; raises ValueError if the executor cannot run it."""
    s = schedule
    p, num_stages, table = s.num_ranks, s.num_stages, s.table
    if num_stages < 2:
        raise ValueError(f"{s.name}: the pipeline executor needs at least 2 stages, got {num_stages}; "
                         f"use pipe >= 2 or call jax.value_and_grad directly")
    rank_of = {int(s.stage_of[r, c]): r for r in range(p) for c in range(s.num_chunks)}
    f_at, g_at, w_at = {}, {}, {}  # (mb, stage) -> tick of F / of B or BW / of W
    for t, r in np.argwhere(table[..., 0] != IDLE):
        kind, mb, c, _ = (int(x) for x in table[t, r])
        key = (mb, int(s.stage_of[r, c]))
        {F: f_at, B: g_at, BW: g_at, W: w_at}[kind][key] = int(t)

    # Messages: ("x", mb, stage) is the input activation of F(mb, stage); ("g", mb, stage) is the output
    # cotangent of stage `stage`, read by its B / BW and again by its W.
    msgs = {}  # key -> (producer rank, producer tick, consumer rank, last use tick)
    for (mb, stage), t in f_at.items():
        if stage + 1 < num_stages:
            key, use = ("x", mb, stage + 1), f_at.get((mb, stage + 1))
        else:  # the last stage's F also computes the loss: it seeds the backward locally
            key, use = ("g", mb, stage), g_at.get((mb, stage))
        msgs[key] = (rank_of[stage], t, rank_of[key[2]], use)
    for (mb, stage), t in g_at.items():
        if stage > 0:
            msgs[("g", mb, stage - 1)] = (rank_of[stage], t, rank_of[stage - 1], g_at.get((mb, stage - 1)))
    for key, (src, t, dst, use) in msgs.items():
        if key[0] == "g":
            use = max(use if use is not None else -1, w_at.get(key[1:], -1))
        if use is None or use <= t:
            raise ValueError(f"{s.name}: {key} is produced at tick {t} but used at tick {use}; run "
                             f"parallax.pipeline.schedule.validate on the schedule and fix what it reports")
        if src != dst and dst not in ((src + 1) % p, (src - 1) % p):
            raise ValueError(f"{s.name}: stage {key[2]} on rank {dst} takes input from rank {src}, which is "
                             f"not a neighbour; place consecutive stages on neighbouring ranks")
        msgs[key] = (src, t, dst, use)

    # Inbox entries per rank: greedy interval colouring in arrival order (optimal for intervals). An entry
    # freed by a read at tick u can take a message that arrives at the end of tick u.
    entry = {}
    free_at = [[] for _ in range(p)]  # per rank: entry -> tick after which it is free
    for key, (src, t, dst, use) in sorted(msgs.items(), key=lambda kv: (kv[1][1], kv[0])):
        pool = free_at[dst]
        i = next((i for i, f in enumerate(pool) if f <= t), len(pool))
        if i == len(pool):
            pool.append(0)
        pool[i] = use
        entry[key] = i
    inbox_size = max(len(pool) for pool in free_at)

    code = np.full((s.num_ticks, p, _NUM_FIELDS), -1, np.int32)
    code[..., _BRANCH] = _IDLE
    code[..., _MB:_SLOT + 1] = 0
    up, down = set(), set()
    for t, r in np.argwhere(table[..., 0] != IDLE):
        kind, mb, c, slot = (int(x) for x in table[t, r])
        stage = int(s.stage_of[r, c])
        first, last = stage == 0, stage == num_stages - 1
        ins = code[t, r]
        ins[_MB], ins[_CHUNK], ins[_SLOT] = mb, c, slot
        if kind == F:
            ins[_BRANCH] = _F_FIRST if first else _F_LAST if last else _F
            if not first:
                ins[_IN] = entry["x", mb, stage]
            out = ("g", mb, stage) if last else ("x", mb, stage + 1)
        else:
            ins[_BRANCH] = {B: (_B, _B_FIRST), W: (_W, _W), BW: (_BW, _BW_FIRST)}[kind][first]
            ins[_IN] = entry["g", mb, stage]
            out = ("g", mb, stage - 1) if kind != W and not first else None
        if out is None:
            continue
        src, _, dst, _ = msgs[out]
        if dst == src:
            ins[_LOCAL] = entry[out]
        elif dst == (src + 1) % p:
            code[t, dst, _FROM_UP] = entry[out]
            up.add((src, dst))
        else:
            code[t, dst, _FROM_DOWN] = entry[out]
            down.add((src, dst))
    branches = tuple(sorted(set(code[..., _BRANCH].ravel().tolist()) | {_IDLE}))
    code[..., _BRANCH] = np.searchsorted(np.array(branches), code[..., _BRANCH])
    return Program(code, branches, inbox_size, s.num_slots, tuple(sorted(up)), tuple(sorted(down)))


def _take_rows(a, idx):
    """`a[idx]` along dim 0. For explicitly sharded arrays dim 0 of the result is unsharded and the other
    dims keep their sharding (a gather needs its output sharding spelled out)."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    if sharding is None or AxisType.Explicit not in sharding.mesh.axis_types:
        return a[idx]
    spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
    return a.at[idx].get(out_sharding=NamedSharding(sharding.mesh, P(None, *spec[1:])))


def to_pipeline_layout(stacked, schedule: Schedule):
    """Stacked layer weights (leaves `[L, ...]`) -> executor layout `[p, v, L / (p * v), ...]`.

    Stage s holds layers `[s * Lc, (s + 1) * Lc)`; `staged[r, c]` is stage `schedule.stage_of[r, c]`.
    """
    p, v = schedule.stage_of.shape

    def one(a):
        if a.shape[0] % (p * v):
            raise ValueError(f"{a.shape[0]} layers do not split evenly into {p * v} pipeline stages "
                             f"({p} ranks x {v} chunks); use a layer count divisible by {p * v}")
        stages = a.reshape(p * v, a.shape[0] // (p * v), *a.shape[1:])  # [S, Lc, ...]
        return _take_rows(stages, schedule.stage_of.ravel()).reshape(p, v, *stages.shape[1:])

    return jax.tree.map(one, stacked)


def from_pipeline_layout(staged, schedule: Schedule):
    """The inverse of `to_pipeline_layout`: `[p, v, Lc, ...]` -> `[p * v * Lc, ...]`."""
    order = np.argsort(schedule.stage_of.ravel())  # flat (r * v + c) of each stage, in stage order

    def one(a):
        return _take_rows(a.reshape(-1, *a.shape[2:]), order).reshape(-1, *a.shape[3:])  # [S, Lc, ...]

    return jax.tree.map(one, staged)


def _place(tree, mesh, specs):
    """Puts `tree` in sharding `specs` (one spec, or a tree of them) if the mesh has explicit axes
    (shard_map then requires it)."""
    if all(t != AxisType.Explicit for t in mesh.axis_types):
        return tree
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.tree.map(lambda a, s: jax.reshard(a, NamedSharding(mesh, s)), tree, specs)


def _vma(a) -> frozenset:
    """The manual mesh axes over which `a` varies (its type inside the shard_map)."""
    return jax.typeof(a).manual_axis_type.varying


def _axes_of(spec) -> set:
    """Mesh axes a PartitionSpec names."""
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def pipeline_value_and_grad(schedule: Schedule, *, first_fn, stage_fn, last_fn, params, inputs, mesh,
                            remat=False, batch_axes=("data", "fsdp"), param_specs=None, input_spec=P()):
    """Loss and gradients of a pipelined model, running `schedule` over the mesh axis `pipe`.

    The model is `sum_mb last_fn(last, stage_{S-1}(... stage_0(first_fn(first, mb)) ...), mb)`, where
    stage s applies `stage_fn` with the weights of stage s.

    params: {'first': pytree (used by stage 0's rank), 'stages': pytree with leaves `[p, v, ...]` in the
      local chunk layout of `to_pipeline_layout` (dim 0 sharded over `pipe`), 'last': pytree}.
    inputs: dict of arrays `[m, mb_rows, ...]`; rows are split over the `batch_axes` of size > 1, the
      dims after them as `input_spec` says (e.g. `P('seq')`: the sequence split over `seq`).
    param_specs: optional {'first', 'stages', 'last'} trees of PartitionSpecs (a missing key or None:
      replicated) for model parallelism inside the stages, e.g. `P(None, 'tensor')`; for 'stages' they
      describe the dims after `[p, v]`. The functions then run on these shards, with collectives of
      their own over the axes the specs (and `input_spec`) name.
    first_fn(first, mb_inputs) -> x `[rows, ...]`; stage_fn(chunk, x, mb_inputs) -> x (same shape and
      dtype); last_fn(last, x, mb_inputs) -> scalar, normalised so the sum over microbatches, over the
      batch shards and over every other manual axis its value varies over (e.g. `seq` shards of the
      tokens) is the loss. A value already complete on every rank of an axis (e.g. a vocabulary-parallel
      cross-entropy, psummed over `tensor`) is invariant over it, and is not summed over it.
    remat: store only each chunk's input and recompute its forward in the backward, instead of storing
      the vjp residuals.

    Returns (loss, grads): grads has the structure and layout of `params` (sharded as `param_specs`), in
    float32 (accumulated in float32), and equals `jax.value_and_grad` of the unpipelined model.

    The shard_map is manual over `pipe`, the batch axes and the axes the specs name. Every weight is cast
    to varying over all of them before any vjp, so no transpose inserts a collective inside the loop; each
    gradient leaf is summed once, after the loop, over the manual axes its spec replicates it over. Every
    rank gets every microbatch's inputs (replicated over `pipe`).

    Collectives inside the functions run inside per-rank switch branches, so they must stay within one
    pipeline rank: those with replica groups (psum, all-gather, reduce-scatter, all-to-all over the model
    axes) do. A `ppermute` does not: an XLA collective-permute has no replica groups, every device joins
    each one, and on XLA:CPU permutes of different branches and ticks get matched (wrong values).
    """
    prog = compile_schedule(schedule)
    p, v, m = schedule.num_ranks, schedule.num_chunks, schedule.num_microbatches
    if mesh.shape.get("pipe") != p:
        raise ValueError(f"schedule {schedule.name} has {p} ranks but the mesh has pipe="
                         f"{mesh.shape.get('pipe')}; set mesh pipe={p}")
    batch = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)
    dp = int(np.prod([mesh.shape[a] for a in batch]))
    for path, a in jax.tree_util.tree_leaves_with_path(inputs):
        if a.ndim < 2 or a.shape[0] != m or a.shape[1] % dp:
            raise ValueError(f"input {jax.tree_util.keystr(path)} has shape {a.shape}; it needs [m={m}, "
                             f"rows, ...] with rows divisible by {dp} (the size of {batch})")
    for path, a in jax.tree_util.tree_leaves_with_path(params["stages"]):
        if a.shape[:2] != (p, v):
            raise ValueError(f"stage weight {jax.tree_util.keystr(path)} has shape {a.shape}; it needs "
                             f"[p={p}, v={v}, ...]: convert stacked weights with to_pipeline_layout")
    param_specs = param_specs or {}
    specs = {}  # full in/out spec per params leaf
    for key in ("first", "stages", "last"):
        given = param_specs.get(key)
        tree = jax.tree.structure(params[key])
        leaf_specs = [P()] * tree.num_leaves if given is None else tree.flatten_up_to(given)
        if key == "stages":
            leaf_specs = [P("pipe", None, *s) for s in leaf_specs]
        specs[key] = jax.tree.unflatten(tree, leaf_specs)
    model_axes = set().union(_axes_of(input_spec), *map(_axes_of, jax.tree.leaves(specs))) - {"pipe"}
    unknown = model_axes - set(mesh.axis_names)
    if unknown or set(batch) & model_axes:
        raise ValueError(f"param_specs / input_spec name axes {sorted(model_axes)}: they must be mesh axes "
                         f"{mesh.axis_names} other than pipe and the batch axes {batch}")
    manual = ("pipe",) + batch + tuple(a for a in mesh.axis_names if a in model_axes and mesh.shape[a] > 1)
    batch_spec = P(None, batch if batch else None, *input_spec)

    def cast(a, axes):  # `a` varying over `axes` as well
        missing = tuple(x for x in axes if x not in _vma(a))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    def vary(tree):  # varying over every manual axis, so that no vjp transpose inserts a psum
        return jax.tree.map(lambda a: cast(a, manual), tree)

    def body(first_p, stage_p, last_p, inputs):
        rank = jax.lax.axis_index("pipe")
        first_p, last_p = vary(first_p), vary(last_p)
        stage_p = vary(jax.tree.map(lambda a: a[0], stage_p))  # [v, ...]
        # Inputs vary over `pipe` too (so that whatever the stages derive from them counts as per-microbatch,
        # see the probe) but stay invariant over the model axes: they are the same on those ranks, which
        # keeps, e.g., a vocabulary-parallel loss invariant over `tensor`.
        inputs = jax.tree.map(lambda a: cast(a, ("pipe",)), inputs)

        def mb_inputs(i):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), inputs)

        def chunk(c):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False), stage_p)

        def vjp_chunk(w, x, mb):
            return jax.vjp(lambda w, x: stage_fn(w, x, mb), w, x)

        # Probe one chunk's pullback to learn its treedef and which leaves are real residuals (to store),
        # which are the weights or microbatch inputs (refetched in the backward), and which are constants.
        mb0, w0 = mb_inputs(0), chunk(0)
        x0 = first_fn(first_p, mb0)
        if remat:
            res_avals = [x0]
        else:
            _, probe = vjp_chunk(w0, x0, mb0)
            probe_leaves, treedef = jax.tree.flatten(probe)
            w_leaves, mb_leaves = jax.tree.leaves(w0), jax.tree.leaves(mb0)
            roles = []  # per pullback leaf: ("w", i) | ("mb", i) | ("const", leaf) | ("res", i)
            for leaf in probe_leaves:
                if any(leaf is a for a in w_leaves):
                    roles.append(("w", next(i for i, a in enumerate(w_leaves) if leaf is a)))
                elif any(leaf is a for a in mb_leaves):
                    roles.append(("mb", next(i for i, a in enumerate(mb_leaves) if leaf is a)))
                elif "pipe" not in _vma(leaf):  # derived from neither the weights nor the inputs
                    roles.append(("const", leaf))
                else:
                    roles.append(("res", sum(r == "res" for r, _ in roles)))
            res_avals = [leaf for (r, _), leaf in zip(roles, probe_leaves) if r == "res"]
        # The loss is summed over `pipe` and over the manual axes last_fn's value varies over.
        loss_vma = _vma(last_fn(last_p, x0, mb0))  # a probe: only its type is used
        loss_axes = tuple(a for a in manual if a == "pipe" or a in loss_vma)

        def forward(c, x, mb):  # -> (y, residual leaves to store)
            if remat:
                return stage_fn(chunk(c), x, mb), (x,)
            w = chunk(c)
            y, pb = vjp_chunk(w, x, mb)
            leaves, refs = jax.tree.leaves(pb), {"w": jax.tree.leaves(w), "mb": jax.tree.leaves(mb)}
            if len(leaves) != len(roles) or any(r in refs and a is not refs[r][i]
                                                for (r, i), a in zip(roles, leaves)):
                raise RuntimeError("stage_fn's pullback changed structure between traces; stage_fn must not "
                                   "branch in Python on the values of its inputs")
            return y, tuple(a for (r, _), a in zip(roles, leaves) if r == "res")

        def pullback(c, slot, mb, slots):
            if remat:
                return vjp_chunk(chunk(c), slots[0][slot], mb)[1]
            w_leaves, mb_leaves = jax.tree.leaves(chunk(c)), jax.tree.leaves(mb)
            leaves = [w_leaves[i] if r == "w" else mb_leaves[i] if r == "mb" else i if r == "const" else
                      slots[i][slot] for r, i in roles]
            return jax.tree.unflatten(treedef, leaves)

        f32 = jnp.float32

        def zeros(a, dtype=None, axes=None):  # zeros like `a`, varying over `axes` (default: as `a` is)
            axes = tuple(_vma(a)) if axes is None else axes
            return cast(jnp.zeros(a.shape, dtype or a.dtype), axes)

        def add(acc, d):
            return jax.tree.map(jnp.add, acc, d)

        def add_chunk(acc, c, d):
            def one(a, b):
                cur = jax.lax.dynamic_index_in_dim(a, c, keepdims=False)
                return jax.lax.dynamic_update_index_in_dim(a, cur + b, c, 0)
            return jax.tree.map(one, acc, d)

        def write(buf, i, value):  # buf[i] = value where i >= 0; in place, outside any switch branch
            j = jnp.maximum(i, 0)
            old = jax.lax.dynamic_index_in_dim(buf, j, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(i >= 0, value, old), j, 0)

        # Each branch reads the slots and the inbox and returns what the tick produced: (message to send
        # (an activation or an input cotangent, shaped like x), residuals to store, dW of the chunk,
        # d first, d last, loss), zeros where it produced nothing. The carry is updated outside the switch,
        # so that XLA updates the buffers in place instead of copying them through the conditional.
        def out(msg=None, res=None, dw=None, dfirst=None, dlast=None, loss=None):
            def f32_or_zeros(grad, like):
                return jax.tree.map(lambda a: zeros(a, f32), like) if grad is None else \
                    jax.tree.map(lambda g: g.astype(f32), grad)
            return (zeros(x0) if msg is None else msg.astype(x0.dtype),
                    tuple(zeros(a) for a in res_avals) if res is None else res,
                    f32_or_zeros(dw, w0), f32_or_zeros(dfirst, first_p), f32_or_zeros(dlast, last_p),
                    zeros(jax.ShapeDtypeStruct((), f32), axes=loss_axes) if loss is None else
                    cast(loss.astype(f32), loss_axes))

        def idle(slots, inbox, ins):
            return out()

        def fwd(slots, inbox, ins):
            y, res = forward(ins[_CHUNK], inbox[ins[_IN]], mb_inputs(ins[_MB]))
            return out(msg=y, res=res)

        def fwd_first(slots, inbox, ins):
            mb = mb_inputs(ins[_MB])
            y, res = forward(ins[_CHUNK], first_fn(first_p, mb), mb)
            return out(msg=y, res=res)

        def fwd_last(slots, inbox, ins):
            mb = mb_inputs(ins[_MB])
            y, res = forward(ins[_CHUNK], inbox[ins[_IN]], mb)
            l, pb = jax.vjp(lambda lp, y: last_fn(lp, y, mb), last_p, y)
            dlast, dy = pb(jnp.ones_like(l))
            return out(msg=dy, res=res, dlast=dlast, loss=l)

        def bwd(slots, inbox, ins, need_dx, need_dw, first):
            mb = mb_inputs(ins[_MB])
            dw, dx = pullback(ins[_CHUNK], ins[_SLOT], mb, slots)(inbox[ins[_IN]])
            dw = dw if need_dw else None
            if need_dx and first:
                return out(dw=dw, dfirst=jax.vjp(lambda fp: first_fn(fp, mb), first_p)[1](dx)[0])
            return out(msg=dx if need_dx else None, dw=dw)

        impls = {
            _IDLE: idle, _F: fwd, _F_FIRST: fwd_first, _F_LAST: fwd_last,
            _B: lambda *a: bwd(*a, True, False, False), _B_FIRST: lambda *a: bwd(*a, True, False, True),
            _W: lambda *a: bwd(*a, False, True, False), _BW: lambda *a: bwd(*a, True, True, False),
            _BW_FIRST: lambda *a: bwd(*a, True, True, True),
        }
        branches = [impls[b] for b in prog.branches]
        stores = np.isin(np.array(prog.branches), (_F, _F_FIRST, _F_LAST))

        def tick(carry, code_t):  # code_t: [p, fields]
            slots, inbox, gw, gf, gl, loss = carry
            ins = code_t[rank]
            msg, res, dw, dfirst, dlast, dloss = jax.lax.switch(ins[_BRANCH], branches, slots, inbox, ins)
            slot = jnp.where(jnp.asarray(stores)[ins[_BRANCH]], ins[_SLOT], -1)
            slots = tuple(write(buf, slot, r) for buf, r in zip(slots, res))
            gw, gf, gl = add_chunk(gw, ins[_CHUNK], dw), add(gf, dfirst), add(gl, dlast)
            inbox = write(inbox, ins[_LOCAL], msg)
            if prog.up_perm:
                inbox = write(inbox, ins[_FROM_UP], jax.lax.ppermute(msg, "pipe", prog.up_perm))
            if prog.down_perm:
                inbox = write(inbox, ins[_FROM_DOWN], jax.lax.ppermute(msg, "pipe", prog.down_perm))
            return (slots, inbox, gw, gf, gl, loss + dloss), None

        slots = tuple(zeros(jax.ShapeDtypeStruct((prog.num_slots, *a.shape), a.dtype), axes=_vma(a))
                      for a in res_avals)
        inbox = zeros(jax.ShapeDtypeStruct((prog.inbox_size, *x0.shape), x0.dtype), axes=_vma(x0))
        acc = jax.tree.map(lambda a: zeros(a, f32), (stage_p, first_p, last_p))
        carry = (slots, inbox, *acc, zeros(jax.ShapeDtypeStruct((), f32), axes=loss_axes))
        (_, _, gw, gf, gl, loss), _ = jax.lax.scan(tick, carry, jnp.asarray(prog.code))
        # Reduce once, after the loop, each leaf over the manual axes it is replicated over: the batch
        # shards (and model axes such as `seq`) hold partial sums, and only the ranks holding stage 0 / the
        # last stage contributed to the first / last grads and the loss. One psum per distinct axis set.
        grads = {"first": gf, "stages": jax.tree.map(lambda a: a[None], gw), "last": gl}
        leaves, tree = jax.tree.flatten((loss, grads))
        axes = [loss_axes] + [tuple(a for a in manual if a not in _axes_of(s)) for s in jax.tree.leaves(specs)]
        for group in dict.fromkeys(a for a in axes if a):
            idx = [i for i, a in enumerate(axes) if a == group]
            for i, r in zip(idx, jax.lax.psum([leaves[i] for i in idx], group)):
                leaves[i] = r
        return jax.tree.unflatten(tree, leaves)

    in_specs = (specs["first"], specs["stages"], specs["last"], batch_spec)
    args = (params["first"], params["stages"], params["last"], inputs)
    args = tuple(_place(a, mesh, s) for a, s in zip(args, in_specs))
    run = jax.shard_map(body, mesh=mesh, in_specs=in_specs, axis_names=set(manual), out_specs=(P(), specs))
    return run(*args)
