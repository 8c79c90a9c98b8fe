"""Optax optimizers: AdamW, Muon (+ AdamW for the rest) or SGD, LR schedules, clipping, and a one-step gradient delay.

Every choice is made from the parameters' logical axis names, never from parameter names:

- **Weight decay** applies to matrices only: two or more dims besides the stacking dims (`layers`,
  `experts`) and `head_dim`; norm scales and biases are never decayed, also when stacked.
- **Muon** (`optim.name=muon`) orthogonalises the momentum of each matrix with Newton-Schulz (the quintic
  (3.4445, -4.7750, 2.0315) iteration, 5 steps, fp32). It takes the matrices of the layer stack (leaves
  with a `layers` dim); those are batches of matrices: the `layers` (and `experts`) dims are batch dims,
  not part of a matrix, so a `[layers, d_in, d_out]` leaf is L independent matrices. Which dims form the matrix: its input side is the first feature dim, its output
  side the rest, except a projection back into the residual stream (last dim `embed`), whose output is the
  last dim: `wq [embed | heads, head_dim]`, `wo [heads, head_dim | embed]`, `w_down [mlp | embed]`.
  Expert weights `[layers, experts, d_in, d_out]` are L x E matrices. Everything outside the stack
  (embeddings, positions, the head), every non-matrix (norms, biases), MoE routers (logical name
  `router`) and any stack matrix that names one of `optim.muon.exclude` goes to AdamW, with the same learning rate schedule.
  The update RMS is matched to AdamW's by default (`optim.muon.scale=rms`: `rms * sqrt(max(d_in, d_out))`,
  0.2 as in Moonlight), so one `lr` serves both; `scale=width` is Keller Jordan's
  `sqrt(max(1, d_out / d_in))` for Muon's own, larger learning rates.
- **Gradient delay** (`optim.grad_delay=1`): the update at step t uses the gradient computed at step t-1's
  parameters, `w[t+1] = w[t] - lr * u(g(w[t-1]))`, what an asynchronous PipeDream-2BW pipeline computes.
  The first step has no earlier gradient and applies none (the optimizer state does not advance). The
  stale gradient lives in the optimizer state, so checkpoints save and restore it exactly.
  `optim.delay_correction=error_feedback` applies `u[t] + (u[t] - u[t-1])` instead (`delay_one_step`).
  Under `pipeline.schedule=2bw` the gradient reaches the optimizer already one step stale (the pipeline
  delays it), so there `delay_correction` needs no `grad_delay` and wraps the optimizer in
  `error_feedback` alone: the same updates as `grad_delay=1` with the correction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from parallax.errors import ConfigError
from parallax.pipeline import schedule as schedules
from parallax.sharding import is_logical_names

_STACKING = ("layers", "experts")
# Always AdamW: a MoE router [embed, router] is a matrix, but an orthogonalised update would give every
# expert's score the same step size, where the router needs each expert's own (as in Moonlight / Kimi).
_ADAMW_ONLY = ("router",)
# `head_dim` splits a feature dim into heads: a [heads, head_dim] bias is still a vector.
_NOT_MATRIX_DIMS = ("head_dim",)
SCHEDULES = ("cosine", "wsd", "constant")
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def lr_schedule(settings: "OptimSettings", total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then (`optim.schedule`):

    - `cosine`: cosine decay to `lr * min_lr_ratio` at `optim.decay_steps` (0: at `total_steps`);
    - `wsd`: warmup-stable-decay: constant `lr`, then a linear decay to `lr * min_lr_ratio` over the last
      `wsd_decay_fraction` of the steps;
    - `constant`: `lr` after the warmup.

    A run stopped early (or whose `train.steps` is raised on resume) keeps the schedule it started with if
    `decay_steps` is set.
    """
    o = settings
    warmup, lr, end = o.warmup_steps, o.lr, o.lr * o.min_lr_ratio
    total = o.decay_steps or total_steps
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=warmup,
                                                  decay_steps=warmup + max(total - warmup, 1), end_value=end)
    ramp = optax.linear_schedule(0.0, lr, max(warmup, 1)) if warmup else optax.constant_schedule(lr)
    if o.schedule == "constant":
        return optax.join_schedules([ramp, optax.constant_schedule(lr)], [warmup])
    decay = min(max(int(round(o.wsd_decay_fraction * total)), 1), max(total - warmup, 1))
    stable = max(total - warmup - decay, 0)
    return optax.join_schedules([ramp, optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay)],
                                [warmup, warmup + stable])


def schedule_warnings(settings: "OptimSettings", total_steps: int) -> list[str]:
    """One line per LR-schedule surprise of a run of `total_steps` steps (printed at its start; not errors: a
    short test run, or an extension at the final LR, can be what the person wants): a warmup that does not
    end within the run, and steps past the schedule's length (`optim.decay_steps`, kept to extend a run),
    which train at its final LR."""
    o, out = settings, []
    schedule = lr_schedule(o, total_steps)
    if o.warmup_steps > total_steps:
        out.append(f"warning: optim.warmup_steps={o.warmup_steps} > train.steps={total_steps}: the LR never reaches "
                   f"optim.lr={o.lr:g} (its last step's is {float(schedule(total_steps - 1)):.3g}); lower warmup_steps")
    if o.schedule != "constant" and 0 < o.decay_steps < total_steps:
        end = float(schedule(o.decay_steps))
        out.append(f"warning: train.steps={total_steps} runs past optim.decay_steps={o.decay_steps}: steps "
                   f"{o.decay_steps + 1}-{total_steps} train at the schedule's final LR {end:.3g}"
                   + (" (min_lr_ratio=0: they change nothing)" if end == 0 else "")
                   + f"; raise decay_steps to {total_steps} for a schedule over the whole run (a new run: resuming "
                   "needs the length it started with)")
    return out


def _is_matrix(names) -> bool:
    return sum(n not in _STACKING + _NOT_MATRIX_DIMS for n in names) >= 2


def decay_mask(logical_names) -> dict:
    """True for parameters that get weight decay: matrices, i.e. two or more dims besides the stacking
    dims (`layers`, `experts`) and `head_dim`. Norm scales and biases are not decayed."""
    return jax.tree.map(_is_matrix, logical_names, is_leaf=is_logical_names)


def muon_dims(names, exclude=("vocab",)) -> MuonDimensionNumbers | None:
    """The matrix a parameter with logical `names` is for Muon, as (reduction, output) axes, or None
    (AdamW): not in the layer stack, not a matrix, a router, or it names one of `exclude`. See the module
    docstring."""
    if "layers" not in names or not _is_matrix(names) or any(n in exclude + _ADAMW_ONLY for n in names):
        return None
    feature = tuple(i for i, n in enumerate(names) if n not in _STACKING)
    if names[feature[-1]] == "embed":
        return MuonDimensionNumbers(reduction_axis=feature[:-1], output_axis=feature[-1:])
    return MuonDimensionNumbers(reduction_axis=feature[:1], output_axis=feature[1:])


class MuonState(NamedTuple):
    count: jax.Array
    mu: optax.Updates  # fp32 momentum of the Muon leaves


# Mesh axes a batch of matrices is spread over for Newton-Schulz, in order: `pipe` first (stacked layers
# are already split over it), then the FSDP / data axes, then the model axes.
_SPREAD_ORDER = ("pipe", "fsdp", "data", "expert", "seq", "tensor")


def _spread(m, mesh):
    """A [batch, d_in, d_out] stack of matrices (sharded like its parameter) -> (the stack padded with zero
    matrices to a multiple of the device count N and split over every mesh axis, the padded size). Each
    device then orthogonalises ceil(batch / N) whole matrices and none repeats another's work (a zero
    matrix stays zero). The axes move onto the batch dim one at a time, the other dims left to XLA
    (`P.UNCONSTRAINED`): each move is then one all-to-all, where a single jump from a two-axis split
    (`fsdp` x `tensor`) makes XLA replicate the whole stack first (its "involuntary full
    rematerialization"). `_unspread` reverses the moves."""
    axes = tuple(a for a in _SPREAD_ORDER if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in axes)
    batch = m.shape[0]
    m = jnp.pad(m, ((0, -(-batch // n) * n - batch), (0, 0), (0, 0)))
    for k in range(1, len(axes) + 1):
        free = P.UNCONSTRAINED if k < len(axes) else None
        m = jax.lax.with_sharding_constraint(m, NamedSharding(mesh, P(axes[:k], free, free)))
    return m, axes


def _unspread(m, mesh, axes, batch: int):
    """The inverse moves of `_spread`, then the padding dropped: from a stack no longer split, so the slice
    moves nothing (without padding the first axis, e.g. `pipe` that already splits the layers, stays)."""
    free = P.UNCONSTRAINED
    for k in range(len(axes) - 1, 0 if m.shape[0] == batch else -1, -1):
        m = jax.lax.with_sharding_constraint(m, NamedSharding(mesh, P(axes[:k] or None, free, free)))
    return m[:batch]


def newton_schulz(x, steps: int = 5, eps: float = 1e-8):
    """Quintic Newton-Schulz on one matrix x [m, n] (fp32): ~ U V^T of its SVD (singular values pushed into
    ~[0.7, 1.2], which Muon tolerates), iterating on the short side. `jax.vmap` it over a stack."""
    x = x.astype(jnp.float32)
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.T
    x = x / (jnp.linalg.norm(x, ord="fro") + eps)
    k = jnp.asarray(NS_COEFFS, jnp.float32)

    def step(_, x):
        g = x @ x.T  # (m, m), m the short side
        return k[0] * x + (k[1] * g + k[2] * g @ g) @ x
    x = jax.lax.fori_loop(0, steps, step, x, unroll=True)
    return x if wide else x.T


def _as_matrices(x, d: MuonDimensionNumbers):
    """x -> ([batch, d_in, d_out], inverse): batch dims first, then the reduction and output dims."""
    red = (d.reduction_axis,) if isinstance(d.reduction_axis, int) else tuple(d.reduction_axis)
    out = (d.output_axis,) if isinstance(d.output_axis, int) else tuple(d.output_axis)
    batch = tuple(i for i in range(x.ndim) if i not in red + out)
    perm = batch + red + out
    shape = tuple(x.shape[i] for i in perm)
    flat = (math.prod(shape[:len(batch)]), math.prod(shape[len(batch):len(batch) + len(red)]),
            math.prod(shape[len(batch) + len(red):]))
    inverse = lambda y: jnp.transpose(y.reshape(shape), tuple(sorted(range(x.ndim), key=lambda i: perm[i])))
    return jnp.transpose(x, perm).reshape(flat), inverse


def scale_by_muon(dims_of, beta: float, nesterov: bool, ns_steps: int, mesh=None) -> optax.GradientTransformation:
    """Muon's direction: bias-corrected EMA momentum (Nesterov optional; the formulas of
    `optax.contrib.scale_by_muon`), orthogonalised per matrix by `newton_schulz`.

    Sharding (`mesh` given): each leaf's matrices are resharded by `_spread` (whole matrices, the stack
    padded and split over all devices, one mesh axis at a time, so XLA moves the shards with
    all-to-alls), orthogonalised locally, and put back; without it XLA runs
    the iteration on the sharded matrices, with collectives inside every matmul, and every device
    repeats the work of the others that hold the same layers.
    """
    def init(params):
        return MuonState(jnp.zeros((), jnp.int32), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def orthogonalize(u, d):
        if not isinstance(d, MuonDimensionNumbers):
            return u
        m, inverse = _as_matrices(u, d)
        if mesh is None:
            return inverse(jax.vmap(lambda a: newton_schulz(a, ns_steps))(m))
        batch = m.shape[0]
        m, axes = _spread(m, mesh)
        return inverse(_unspread(jax.vmap(lambda a: newton_schulz(a, ns_steps))(m), mesh, axes, batch))

    def update(updates, state, params=None):
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = state.count + 1
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, optax.tree.bias_correction(mu, beta, count + 1),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        return jax.tree.map(orthogonalize, mu_hat, dims_of(mu_hat)), MuonState(count, mu)

    return optax.GradientTransformation(init, update)


def _scale_by_shape(dims_of, rms: float | None) -> optax.GradientTransformation:
    """Scales each orthogonalised update: `rms * sqrt(max(d_in, d_out))` (AdamW-matched RMS), or with `rms`
    None `sqrt(max(1, d_out / d_in))`; d_in / d_out are the products of the reduction / output dims."""
    def scale(u, d):
        if not isinstance(d, MuonDimensionNumbers):
            return u
        fan = lambda axes: math.prod(u.shape[a] for a in ((axes,) if isinstance(axes, int) else axes))
        d_in, d_out = fan(d.reduction_axis), fan(d.output_axis)
        if rms is not None:  # computed in fp32 as optax does, so the two agree to the last bit
            return jnp.sqrt(jnp.maximum(d_in, d_out)) * rms * u
        return jnp.sqrt(jnp.maximum(1, d_out / d_in)) * u

    def update(updates, state, params=None):
        return jax.tree.map(scale, updates, dims_of(updates)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _muon(m: Muon, s: OptimSettings, schedule, logical_names, mesh=None) -> optax.GradientTransformation:
    dims = jax.tree.map(lambda n: muon_dims(n, m.exclude), logical_names, is_leaf=is_logical_names)
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))

    def muon_dims_of(params):  # the Muon partition's tree: dims where Muon applies, MaskedNode elsewhere (also
        # where an outer mask left a MaskedNode: LoRA's frozen leaves, `make_optimizer`'s `trainable`)
        return jax.tree.map(lambda d, p: p if d is None or isinstance(p, optax.MaskedNode) else d, dims, params,
                            is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))

    muon = optax.chain(
        scale_by_muon(muon_dims_of, m.beta, m.nesterov, m.ns_steps, mesh),
        _scale_by_shape(muon_dims_of, m.rms if m.scale == "rms" else None),
        optax.add_decayed_weights(s.weight_decay),
        optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": muon, "adamw": m.adamw.transform(s, schedule, logical_names)}, labels)


class DelayState(NamedTuple):
    inner: optax.OptState
    stale: optax.Updates  # the gradient of the previous step (fp32), applied at this one
    started: jax.Array  # bool: whether `stale` holds a gradient yet
    last: optax.Updates  # error feedback: the previous step's update (fp32); () without the correction


def delay_one_step(inner: optax.GradientTransformation, error_feedback: bool = False) -> optax.GradientTransformation:
    """`inner` applied to the gradient of the previous step: w[t+1] = w[t] - u(g(w[t-1])). The first call
    has no earlier gradient: it returns zero updates and leaves `inner`'s state as it was.

    `error_feedback`: the update applied at step t is `u[t] + (u[t] - u[t-1])` (u[t] the inner update from
    the stale gradient, u[-1] = 0). Under a one-step delay the update a fresh gradient would give at step
    t is only known at step t+1; predicting it as the latest stale one (u[t+1] ~ u[t]), the error of the
    step just taken is u[t] - u[t-1], and it is fed into the next one. Summed, the weights are the
    delay-free sum of the updates plus the latest update once more: w[t+1] = w[0] - sum(u[..t]) - u[t],
    the point the fresh trajectory is predicted to reach, which is where the next gradient is taken.
    Costs one fp32 copy of the parameters. (Our reading of the error-feedback correction for one-step
    delay of arXiv 2606.30634; its exact rule could not be checked here.)"""
    f32 = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)

    def init(params):
        return DelayState(inner.init(params), f32(params), jnp.zeros((), bool), f32(params) if error_feedback else ())

    def update(grads, state, params=None):
        updates, new_inner = inner.update(state.stale, state.inner, params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(state.started, a, b), new, old)
        updates = jax.tree.map(lambda u: jnp.where(state.started, u, jnp.zeros_like(u)), updates)
        last = ()
        if error_feedback:
            updates, last = _feed_back(updates, state.last)
        stale = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return updates, DelayState(keep(new_inner, state.inner), stale, jnp.ones((), bool), last)

    return optax.GradientTransformation(init, update)


def _feed_back(updates, last):
    """(applied, new last): the update applied is `u[t] + (u[t] - u[t-1])`; `u[t]` is kept in fp32."""
    new_last = jax.tree.map(lambda u: u.astype(jnp.float32), updates)
    applied = jax.tree.map(lambda u, prev: (2 * u.astype(jnp.float32) - prev).astype(u.dtype), updates, last)
    return applied, new_last


class FeedbackState(NamedTuple):
    inner: optax.OptState
    last: optax.Updates  # the previous step's update (fp32)


def error_feedback(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`delay_one_step`'s correction alone, for gradients that arrive one step stale already (the 2bw
    pipeline computes batch t-1's gradient at the weights of step t-1 and applies it at step t): applies
    `u[t] + (u[t] - u[t-1])`, u[-1] = 0. A step the trainer does not apply (2bw's first, a skipped one)
    keeps this state as it was, as `grad_delay` keeps its own, so both count the same updates."""
    def init(params):
        return FeedbackState(inner.init(params), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(grads, state, params=None):
        updates, new_inner = inner.update(grads, state.inner, params)
        updates, last = _feed_back(updates, state.last)
        return updates, FeedbackState(new_inner, last)

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """`optim.name=adamw`: Adam's moments with decoupled weight decay of the matrices (`decay_mask`)."""
    KEYS = dict(  # config.optim.adamw; also Muon's AdamW part
        b1=0.9,  # Adam's first-moment decay
        b2=0.95,  # Adam's second-moment decay
        eps=1e-8,  # Adam's epsilon
    )
    b1: float
    b2: float
    eps: float

    @classmethod
    def resolve(cls, o) -> "AdamW":
        a = o.adamw
        return cls(b1=float(a.b1), b2=float(a.b2), eps=float(a.eps))

    def transform(self, s: "OptimSettings", schedule, logical_names, mesh=None) -> optax.GradientTransformation:
        return optax.adamw(learning_rate=schedule, b1=self.b1, b2=self.b2, eps=self.eps,
                           weight_decay=s.weight_decay, mask=decay_mask(logical_names))


@dataclasses.dataclass(frozen=True)
class Muon:
    """`optim.name=muon`: Muon for the stack's matrices, `adamw` for the rest (the module docstring)."""
    KEYS = dict(  # config.optim.muon
        beta=0.95,  # Muon's momentum
        nesterov=True,  # Nesterov momentum
        ns_steps=5,  # Newton-Schulz iterations
        scale="rms",  # rms (the update's RMS matched to AdamW's: rms) | width (sqrt(d_out / d_in))
        rms=0.2,  # scale=rms: the RMS of Muon's update
        exclude="vocab",  # logical names (comma-separated) whose parameters go to AdamW (optim.adamw)
    )
    beta: float
    nesterov: bool
    ns_steps: int
    scale: str  # rms | width
    rms: float
    exclude: tuple  # logical names whose parameters go to AdamW
    adamw: AdamW

    @classmethod
    def resolve(cls, o) -> "Muon":
        m = o.muon
        if m.scale not in ("rms", "width"):
            raise ConfigError(f"config.optim.muon.scale={m.scale!r}: expected one of rms, width")
        if int(m.ns_steps) < 1 or not 0 <= float(m.beta) < 1 or float(m.rms) <= 0:
            raise ConfigError(f"config.optim.muon: ns_steps={m.ns_steps} must be >= 1, beta={m.beta} in [0, 1) and "
                              f"rms={m.rms} > 0")
        return cls(beta=float(m.beta), nesterov=bool(m.nesterov), ns_steps=int(m.ns_steps), scale=str(m.scale),
                   rms=float(m.rms), exclude=_names(m.exclude), adamw=AdamW.resolve(o))

    def transform(self, s: "OptimSettings", schedule, logical_names, mesh=None) -> optax.GradientTransformation:
        return _muon(self, s, schedule, logical_names, mesh)


@dataclasses.dataclass(frozen=True)
class SGD:
    """`optim.name=sgd`: heavy-ball momentum (0: plain), decoupled decay. Linear in the gradients: DiLoCo's
    exactness reference (a mean of steps is a step)."""
    KEYS = dict(  # config.optim.sgd
        momentum=0.0,  # heavy-ball momentum (0: plain SGD)
    )
    momentum: float

    @classmethod
    def resolve(cls, o) -> "SGD":
        if not 0 <= float(o.sgd.momentum) < 1:
            raise ConfigError(f"config.optim.sgd.momentum={o.sgd.momentum}: expected a value in [0, 1)")
        return cls(momentum=float(o.sgd.momentum))

    def transform(self, s: "OptimSettings", schedule, logical_names, mesh=None) -> optax.GradientTransformation:
        # the decay after the momentum, so it stays decoupled (lr * wd * p), as AdamW's
        return optax.chain(*([optax.trace(self.momentum)] if self.momentum else []),
                           optax.add_decayed_weights(s.weight_decay, decay_mask(logical_names)),
                           optax.scale_by_learning_rate(schedule))


# `optim.name` -> its typed settings: a new optimizer is one class here with its keys (`KEYS`: the section
# `config.optim.NAME`, each key's meaning in a comment), `resolve(optim_section)` (its own ConfigErrors) and
# `transform(settings, schedule, logical_names, mesh)`, and one entry in this table.
OPTIMIZERS = {"adamw": AdamW, "muon": Muon, "sgd": SGD}
NAMES = tuple(OPTIMIZERS)
# The keys every optimizer reads (`config.optim`); each optimizer's own are its section (`OPTIMIZERS[name].KEYS`).
KEYS = dict(
    name="adamw",  # adamw | muon (Muon for matrices, optim.adamw for the rest) | sgd: reads optim.NAME's keys
    lr=1e-3,  # peak learning rate
    warmup_steps=10,  # linear warmup from 0 to lr
    weight_decay=0.1,  # decoupled weight decay, of matrices only (not norm scales or biases)
    clip_norm=1.0,  # global gradient-norm clipping (0: none)
    min_lr_ratio=0.1,  # the schedule ends at lr * min_lr_ratio
    decay_steps=0,  # the schedule's length (0: train.steps); keep it to extend a run
    schedule="cosine",  # cosine | wsd (warmup-stable-decay) | constant
    wsd_decay_fraction=0.2,  # wsd: the final fraction of the steps that decays linearly
    grad_delay=0,  # 0 | 1: apply the previous step's gradient (a one-step delay)
    delay_correction="none",  # none | error_feedback: correct for the gradient delay
    offload_state=False,  # keep the optimizer state in host memory; the step brings it to the chips to update
)


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """The `optim` section, checked and typed (`resolve`): what `make_optimizer` and `lr_schedule` read."""
    name: str
    method: AdamW | Muon | SGD  # the named optimizer's own settings
    lr: float
    warmup_steps: int
    weight_decay: float
    clip_norm: float
    min_lr_ratio: float
    decay_steps: int
    schedule: str  # cosine | wsd | constant
    wsd_decay_fraction: float
    grad_delay: int  # 0 | 1
    error_feedback: bool  # delay_correction=error_feedback
    offload_state: bool
    stale_gradients: bool = False  # the gradients arrive one step stale already (2bw)


def _names(text) -> tuple:
    return tuple(n.strip() for n in str(text).split(",") if n.strip())


def resolve(section, stale_gradients: bool = False) -> OptimSettings:
    """The `optim` config section as `OptimSettings`; raises ConfigError (one line) for settings
    `make_optimizer` cannot build. `stale_gradients`: the gradients arrive one step stale already
    (`pipeline.schedule=2bw`)."""
    o = section
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"config.optim.name={o.name!r}: expected one of {', '.join(NAMES)}")
    choices = (("schedule", SCHEDULES), ("delay_correction", ("none", "error_feedback")))
    for key, valid in choices:
        if o[key] not in valid:
            raise ConfigError(f"config.optim.{key}={o[key]!r}: expected one of {', '.join(valid)}")
    if int(o.grad_delay) not in (0, 1):
        raise ConfigError(f"config.optim.grad_delay={o.grad_delay}: expected 0 or 1")
    if o.delay_correction != "none" and not int(o.grad_delay) and not stale_gradients:
        steady = " or ".join(schedules.names(steady=True))
        raise ConfigError(f"config.optim.delay_correction={o.delay_correction!r} corrects a gradient delay, and "
                          f"optim.grad_delay=0; set optim.grad_delay=1 (or pipeline.schedule={steady} with mesh.pipe "
                          f"> 1, whose gradients are one step stale) or optim.delay_correction=none")
    if not 0 < float(o.wsd_decay_fraction) <= 1:
        raise ConfigError(f"config.optim.wsd_decay_fraction={o.wsd_decay_fraction}: expected a fraction in (0, 1]")
    methods = {name: cls.resolve(o) for name, cls in OPTIMIZERS.items()}  # every optimizer's keys are checked
    if o.lr < 0 or o.warmup_steps < 0 or o.decay_steps < 0 or o.weight_decay < 0 or o.clip_norm < 0:
        raise ConfigError(f"config.optim: lr={o.lr}, warmup_steps={o.warmup_steps}, decay_steps={o.decay_steps}, "
                          f"weight_decay={o.weight_decay}, clip_norm={o.clip_norm} must all be >= 0")
    return OptimSettings(
        name=str(o.name), method=methods[o.name], lr=float(o.lr), warmup_steps=int(o.warmup_steps),
        weight_decay=float(o.weight_decay), clip_norm=float(o.clip_norm), min_lr_ratio=float(o.min_lr_ratio),
        decay_steps=int(o.decay_steps), schedule=str(o.schedule), wsd_decay_fraction=float(o.wsd_decay_fraction),
        grad_delay=int(o.grad_delay), error_feedback=o.delay_correction == "error_feedback",
        offload_state=bool(o.offload_state), stale_gradients=bool(stale_gradients))


def check_exclude(section, rules) -> None:
    """`optim.muon.exclude` of the `optim` section names logical axes of the model (`rules`: its rules
    table), whichever optimizer is named (a later switch to Muon must not fail)."""
    for name in _names(section.muon.exclude):
        if name not in rules:
            raise ConfigError(f"config.optim.muon.exclude={section.muon.exclude!r}: {name!r} is not a logical axis "
                              f"name of this model (names: {', '.join(sorted(rules))}); e.g. vocab")


def schedule_count(opt_state) -> jax.Array:
    """The LR schedule's index for the next update: the updates applied so far. It lags `state['step']` by
    the first step under `grad_delay` (which applies nothing) and by every step `nan_policy=skip` dropped,
    since both leave the whole optimizer state, its counts included, as it was."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "ScaleByScheduleState")
    if not found:
        raise ValueError("the optimizer state holds no ScaleByScheduleState; make_optimizer builds one")
    return found[0][1].count


def make_optimizer(settings: OptimSettings, total_steps: int, logical_names,
                   mesh=None, trainable=None) -> optax.GradientTransformation:
    """The optimizer `settings.name` names (adamw | muon | sgd), after global-norm clipping when `clip_norm`
    > 0, applied one step late when `grad_delay` is 1 (with `delay_correction`). `mesh`: where Muon spreads
    its Newton-Schulz. With `stale_gradients` the caller delays the gradients itself (2bw), so only
    `delay_correction` is added. `trainable` (a bool per parameter leaf, e.g. LoRA's adapters; None: all):
    the others are frozen: no state, no update (not even weight decay), and the clipping norm is theirs."""
    s = settings
    tx = s.method.transform(s, lr_schedule(s, total_steps), logical_names, mesh)
    if s.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(s.clip_norm), tx)
    if s.stale_gradients and s.error_feedback:
        tx = error_feedback(tx)
    elif s.grad_delay:
        tx = delay_one_step(tx, error_feedback=s.error_feedback)
    if trainable is None:
        return tx
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable)
    return optax.partition({"train": tx, "frozen": optax.set_to_zero()}, labels)
