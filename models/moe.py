"""A Llama-style decoder whose MLP is a mixture of experts (Mixtral, DeepSeek-V3 style routing).

Attention, norms and RoPE are Llama's (`models.llama`); each layer's MLP is E routed SwiGLU experts, of
which every token uses k, plus optional always-on shared experts (one SwiGLU of width
shared_experts * d_ff_expert, Llama's MLP). Settings live in `config.model.moe` (see `MOE_DEFAULTS`).

Routing (router logits in fp32, [B, T, E]):
- `router=softmax` (Mixtral): scores = softmax(logits); the top-k scores are the gates, renormalised to
  sum to 1 when `norm_topk`.
- `router=sigmoid` (DeepSeek-V3): scores = sigmoid(logits), top-k, gates renormalised over the chosen
  (`norm_topk`) and scaled by `router_scale`.
- Aux-loss-free balancing (`bias_rate` > 0, DeepSeek-V3): a per-expert bias is added to the scores for
  *choosing* experts only; the gates come from the unbiased scores. After each optimizer step the bias
  moves by `bias_rate * sign(mean load - load)` (`after_step`), from the step's global per-expert load.
  Why a parameter: the trainer keeps a model's whole state in `params` (checkpointed, sharded, restored
  with it), so the bias is saved with the weights for free. It is read through `stop_gradient`, so its
  gradient is exactly 0 and AdamW leaves it exactly as it is (no decay: it is not a matrix); only the
  model's own `after_step` hook changes it.

Aux losses, added to the loss sum and so averaged over tokens like the cross-entropy:
- load balance (Switch): `balance_weight * E * sum_e f_e * P_e` per sequence row (f_e the fraction of the
  row's k*T assignments choosing e, P_e the mean router probability of e: softmax scores, or sigmoid scores
  normalised per token), weighted by the row's weight total;
- router z-loss (ST-MoE): `z_weight * logsumexp(logits)^2` per token.

Per layer the layer returns (x, aux) with this rank's sums (`parallax.model`): `loss`, `balance`, `z`,
`load` [E] (assignments per expert, before dropping), `dropped` and `assignments`; `aux_metrics` turns
them into the train metrics aux_loss, balance_loss, z_loss, load_min / load_max (relative to a uniform
load), load_cv (coefficient of variation over experts, mean over layers) and dropped (the fraction of
assignments over capacity).

Dense first layers (`moe.first_dense` > 0, DeepSeek-V3: 3): the blocks are one homogeneous scanned
stack, and a per-layer dense/MoE flag would make every layer carry both MLPs' weights. So the dense layers
are a second, small stack of Llama blocks (`dense_blocks`, MLP width `moe.dense_d_ff`) that `embed` runs
after the token embedding: they are part of the embedding in the contract's terms, so on a pipeline they
run on the first stage (their `layers` dim is split over `pipe` when stored: `first_dense` must divide by
mesh.pipe). `config.model.num_layers` counts the MoE layers only.

Expert parallelism, capacity and dropless dispatch: `parallax.parallel.expert`. Sequence parallelism
(`mesh.seq`, any `model.attention` that runs there): each rank routes its own tokens; a routing group is
still the whole row, so capacity drops (`ep_lib.seq_offsets`) and the balance loss (`aux`) see the row
through small [B, E] collectives over `seq`, and every mesh drops and balances as one device does.

Generating (`par.decoding`), every token is routed, dropless, whatever `moe.dispatch`: with capacity, a
row's drops depend on the tokens sharing its group (a prompt's padding, the window a sampler recomputes),
so a prompt's continuation would depend on the batch and the decoding algorithm. Capacity is a training
device; an inference without drops is the limit it approximates (MaxText also decodes dropless).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models import llama
from parallax.errors import ConfigError
from parallax import compat
from parallax import model as model_lib
from parallax import sharding as sharding_lib
from parallax.model import DENSE, Model, Parallelism, apply_blocks, attention_flops_per_token, param_flops_per_token
from parallax.parallel import expert as ep_lib
from parallax.parallel.manual import log_once

MOE_DEFAULTS = dict(
    num_experts=8,  # routed experts per layer
    top_k=2,  # experts each token is routed to
    d_ff_expert=64,  # hidden width of one expert
    shared_experts=0,  # always-on experts: one SwiGLU of width shared_experts * d_ff_expert
    router="softmax",  # softmax (Mixtral) | sigmoid (DeepSeek-V3)
    router_scale=1.0,  # gates are multiplied by this (DeepSeek-V3: 2.5)
    norm_topk=True,  # renormalise the k gates to sum to 1
    dispatch="capacity",  # capacity (drops past C slots; all-to-all over expert) | ragged (dropless; ragged_all_to_all)
    capacity_factor=2.0,  # slots per expert and row = ceil(factor * T * k / E); 0: T slots (drops nothing)
    grouped_impl="auto",  # grouped matmuls (ragged, or expert=1): auto (megablox on TPU) | ragged_dot | megablox
    ff_chunks=1,  # grouped matmuls: the expert width in this many slices, one live at a time (memory)
    ep_buffer=0.0,  # ragged over mesh.expert: receive buffer in balanced shares (0: worst case, dropless)
    dispatch_chunks=1,  # over expert > 1: this many row groups (capacity: all-to-alls overlap matmuls; ragged: memory)
    balance_weight=0.01,  # Switch load-balancing loss weight
    z_weight=0.001,  # router z-loss weight
    bias_rate=0.0,  # aux-loss-free balancing: bias step per optimizer step (0: off)
    first_dense=0,  # dense Llama layers before the num_layers MoE layers (see the module docstring)
    dense_d_ff=0,  # their MLP width (needed when first_dense > 0)
)
ROUTERS = ("softmax", "sigmoid")
DISPATCH = ("capacity", "ragged")


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
    zeros = jnp.zeros(shape, dtype)
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


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
    ctx = sharding_lib.activation_context()
    if ctx is None:
        return fn(_whole, h, idx, gates, *weights)
    mesh, rules = ctx
    spec = sharding_lib.logical_to_spec(("batch",), rules, mesh)
    if not len(spec) or spec[0] is None:
        return fn(_whole, h, idx, gates, *weights)
    P = jax.sharding.PartitionSpec
    rows = P(spec[0])
    batch_axes = set(sharding_lib.spec_axes(spec[0]))
    w_specs = tuple(sharding_lib.logical_to_spec(n, rules, mesh) for n in names)
    w_axes = [{a for e in s for a in sharding_lib.spec_axes(e)} for s in w_specs]
    if any(not axes <= batch_axes for axes in w_axes):  # a weight split over a non-batch axis: left to GSPMD
        return fn(_whole, h, idx, gates, *weights)
    pcast = getattr(jax.lax, "pcast", None)

    def gather(local):
        whole = []
        for w, w_spec, axes in zip(local, w_specs, w_axes):
            # Varying over the other batch axes *before* the gather: the backward then sums the shard's
            # gradient over them (a psum of 1/fsdp of the weight) and reduce-scatters, instead of all-reducing
            # the whole gathered gradient over `data`.
            extra = tuple(a for a in mesh.axis_names if a in batch_axes and a not in axes)
            if extra:
                w = pcast(w, extra, to="varying") if pcast is not None else jax.lax.pvary(w, extra)
            for dim, entry in enumerate(w_spec):
                axes = sharding_lib.spec_axes(entry)
                if axes:
                    w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
            whole.append(w)
        return tuple(whole)

    def per_shard(h, idx, gates, *local):
        return fn(gather, h, idx, gates, *local)

    region = jax.shard_map(per_shard, mesh=mesh, in_specs=(rows, rows, rows, *w_specs), out_specs=(rows, rows, rows))
    return region(h, idx, gates, *weights)


@dataclasses.dataclass(frozen=True)
class MoESettings:
    num_experts: int
    top_k: int
    d_ff_expert: int
    shared_experts: int
    router: str
    router_scale: float
    norm_topk: bool
    dispatch: str
    grouped_impl: str
    ff_chunks: int
    ep_buffer: float
    capacity_factor: float
    dispatch_chunks: int
    balance_weight: float
    z_weight: float
    bias_rate: float
    first_dense: int
    dense_d_ff: int


def _settings(model_config) -> MoESettings:
    return MoESettings(**{f.name: model_config.moe[f.name] for f in dataclasses.fields(MoESettings)})


def _llama_config(model_config) -> llama.LlamaConfig:
    moe = model_config.moe
    return llama.LlamaConfig.from_config({**dict(model_config), "d_ff": max(1, moe.shared_experts * moe.d_ff_expert)})


class MoEBlocks(llama.Blocks):
    """Llama's stacked attention (and, with shared experts, its MLP as the shared experts) plus the router
    and the stacked routed experts [layers, experts, ...]."""

    def __init__(self, cfg: llama.LlamaConfig, moe: MoESettings, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        L, D, E, F = cfg.num_layers, cfg.d_model, moe.num_experts, moe.d_ff_expert
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * L)
        self.moe = moe
        if not moe.shared_experts:  # Llama's dense MLP is the shared experts; none here
            del self.w_gate, self.w_up, self.w_down
        self.w_router = llama._param(rngs, (L, D, E), ("layers", "embed", "router"), std)
        self.router_bias = nnx.Param(jnp.zeros((L, E)), logical=("layers", "router"))  # only after_step moves it
        self.we_gate = llama._param(rngs, (L, E, D, F), ("layers", "experts", "embed", "mlp"), std)
        self.we_up = llama._param(rngs, (L, E, D, F), ("layers", "experts", "embed", "mlp"), std)
        self.we_down = llama._param(rngs, (L, E, F, D), ("layers", "experts", "mlp", "embed"), out_std)

    def layer(self, x, batch, par: Parallelism = DENSE):
        """One decoder layer: Llama attention, then the MoE MLP. x [B, T, D] (this rank's [B, T/t, D] under
        par) -> (x, aux sums of this rank's tokens)."""
        cfg, moe = self.cfg, self.moe
        x = self.attend(x, batch, par)
        h = par.gather_seq(llama.rms_norm(x, par.weight(self.mlp_norm), cfg.norm_eps))  # (B, T, D)
        idx, gates, probs, logits = self.route(h, par)
        y, keep, load = self.routed(h, idx, gates, par)
        if moe.shared_experts:
            y = y + self.mlp(h, par)
        x = llama.constrain(x + par.scatter_seq(y), ("batch", "length", "act_embed"))
        return x, self.aux(batch, logits, probs, keep, load, par)

    def route(self, h, par):
        """h [B, T, D] -> (expert indices [B, T, k], gates [B, T, k] fp32, probabilities for the balance
        loss [B, T, E], router logits [B, T, E] fp32)."""
        moe = self.moe
        w = par.weight(self.w_router).astype(jnp.float32)
        logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), w)
        if moe.router == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
            probs = scores
        else:
            scores = jax.nn.sigmoid(logits)
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        bias = jax.lax.stop_gradient(par.weight(self.router_bias))  # choosing only, never the gates
        _, idx = jax.lax.top_k(scores + bias, moe.top_k)  # (B, T, k)
        gates = jnp.take_along_axis(scores, idx, axis=-1)
        if moe.norm_topk:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        return idx, gates * moe.router_scale, probs, logits

    def routed(self, h, idx, gates, par):
        """The routed experts' output [B, T, D] (partial sums over `tensor`), keep mask, load [B, E]."""
        moe, dt, w = self.moe, self.cfg.compute_dtype, par.weight
        wg, wu, wd = w(self.we_gate, dt), w(self.we_up, dt), w(self.we_down, dt)  # (E/ep, D, F/t), (E/ep, F/t, D)
        h = h.astype(dt)
        # Grouped matmuls: dropless routing, decoding (every token routed) and, on one expert rank, capacity
        # routing too (its kept assignments only: `ep_lib.moe_ragged`'s `cap`; dense slots only where they
        # travel as fixed-size all-to-alls).
        dropless = moe.dispatch == "ragged" or (par.decoding and par.expert == 1)
        row = h.shape[1] * par.seq  # a routing group is a whole row, split over `seq` in the region
        cap = ep_lib.capacity(row, moe.top_k, moe.num_experts, moe.capacity_factor)
        cap = None if dropless or cap >= row else cap  # T slots: nothing can drop
        # A row split over `seq`: the row positions of this rank's assignments, so drops match one device.
        order = par.piece_order or tuple(range(par.seq))  # the row's layout over seq
        offset = ep_lib.seq_offsets(idx, moe.num_experts, order) if cap and par.seq > 1 else None
        if dropless or par.expert == 1:
            impl = ep_lib.grouped_impl(moe.grouped_impl, par.platform)
            log_once(f"grouped matmuls: {impl} (moe.grouped_impl={moe.grouped_impl}), "
                     f"{moe.ff_chunks} chunk(s) of the expert width")

            def grouped_with(gather, ws, full=False):  # full: the groups cover every row (no padding rows)
                def grouped(xs, sizes):  # (M, D) sorted by expert, sizes (E,)
                    return _grouped_swiglu(xs, sizes, ws, gather, moe.ff_chunks, lambda x, w: ep_lib.grouped_matmul(
                        x, w, sizes, impl, par.platform, full=full))
                return grouped
            if par.expert > 1:
                return ep_lib.moe_ragged_ep(h, idx, gates, moe.num_experts, grouped_with(_whole, (wg, wu, wd)),
                                            par.expert, buffer=float(moe.ep_buffer), chunks=moe.dispatch_chunks)
            names = [p.logical[1:] for p in (self.we_gate, self.we_up, self.we_down)]  # one layer's
            if offset is not None:  # inside the manual region: no per-shard split to make
                return ep_lib.moe_ragged(h, idx, gates, moe.num_experts, grouped_with(_whole, (wg, wu, wd)), cap,
                                         offset)
            return _per_batch_shard(lambda gather, h, idx, gates, *ws: ep_lib.moe_ragged(
                h, idx, gates, moe.num_experts, grouped_with(gather, ws, full=cap is None), cap), h, idx, gates,
                (wg, wu, wd), names)

        def experts(xe):  # (E/ep, G, C, D)
            act = jax.nn.silu(jnp.einsum("egcd,edf->egcf", xe, wg)) * jnp.einsum("egcd,edf->egcf", xe, wu)
            return jnp.einsum("egcf,efd->egcd", act, wd)
        cap = row if cap is None else cap
        return ep_lib.moe_capacity(h, idx, gates, moe.num_experts, cap, experts, par.expert, moe.dispatch_chunks,
                                   offset)

    def aux(self, batch, logits, probs, keep, load, par: Parallelism = DENSE):
        """This rank's aux sums (see the module docstring); the loss entries are weighted by token weights.
        A row split over `seq`: its balance term takes the whole row's load and mean probabilities (a psum
        over `seq` of [B, E] sums), weighted by this rank's share of the row's weights, so the sum over the
        seq ranks is the row's term."""
        moe = self.moe
        weights = batch["weights"].astype(jnp.float32)  # (B, T/s)
        t, k = logits.shape[1] * par.seq, moe.top_k
        row_load, row_probs = load.astype(jnp.float32), jnp.sum(probs, axis=1)  # (B, E) each
        if par.seq > 1:
            row_load, row_probs = jax.lax.psum((row_load, row_probs), "seq")
        f = row_load / (t * k)  # (B, E) fraction of each row's assignments
        balance_row = moe.num_experts * jnp.sum(f * row_probs / t, axis=-1)  # (B,)
        balance = jnp.sum(balance_row * jnp.sum(weights, axis=1))
        z = jnp.sum(weights * jax.nn.logsumexp(logits, axis=-1) ** 2)
        stop = jax.lax.stop_gradient
        return dict(loss=moe.balance_weight * balance + moe.z_weight * z, balance=stop(balance), z=stop(z),
                    load=jnp.sum(load, axis=0).astype(jnp.float32),
                    dropped=jnp.sum(~keep).astype(jnp.float32),
                    assignments=jnp.asarray(keep.size, jnp.float32))


class MoE(Model):
    """Decoder-only MoE LM: Llama's embedding, head and attention; `MoEBlocks` as the stack."""

    parallel_axes = ("tensor", "seq", "expert")
    rules = {"router": None}  # the router's expert dim: every rank scores every expert

    @staticmethod
    def config_defaults() -> dict:
        defaults = llama.Llama.config_defaults()
        del defaults["d_ff"], defaults["mlp_chunks"]  # the experts' width is moe.d_ff_expert; no dense MLP chunks
        return {**defaults, "moe": dict(MOE_DEFAULTS)}

    @staticmethod
    def check_config(m, sizes, config) -> None:
        moe = m.moe
        missing = set(MOE_DEFAULTS) - set(moe.keys())
        extra = set(moe.keys()) - set(MOE_DEFAULTS)
        if missing or extra:
            key = sorted(missing or extra)[0]
            raise ConfigError(f"config.model.moe.{key}: {'missing' if missing else 'not a key of model.moe'} "
                              f"(its keys: {', '.join(sorted(MOE_DEFAULTS))}); start from default_config(model='moe')")
        for key in ("num_experts", "top_k", "d_ff_expert", "dispatch_chunks", "ff_chunks"):
            if int(moe[key]) <= 0:
                raise ConfigError(f"config.model.moe.{key}={moe[key]}: must be positive")
        if moe.top_k > moe.num_experts:
            raise ConfigError(f"config.model.moe.top_k={moe.top_k}: more than num_experts={moe.num_experts}")
        if moe.router not in ROUTERS:
            raise ConfigError(f"config.model.moe.router={moe.router!r}: expected one of {', '.join(ROUTERS)}")
        if moe.grouped_impl not in ep_lib.GROUPED_IMPLS:
            raise ConfigError(f"config.model.moe.grouped_impl={moe.grouped_impl!r}: expected one of "
                              f"{', '.join(ep_lib.GROUPED_IMPLS)}")
        if moe.dispatch not in DISPATCH:
            raise ConfigError(f"config.model.moe.dispatch={moe.dispatch!r}: expected one of {', '.join(DISPATCH)}")
        ep, tp = sizes["expert"], sizes["tensor"]
        grouped = moe.dispatch == "ragged" or ep == 1  # capacity on one expert rank runs grouped matmuls too
        where = f"(dispatch={moe.dispatch!r}, mesh.expert={ep})"
        if moe.grouped_impl != "auto" and not grouped:
            raise ConfigError(f"config.model.moe.grouped_impl={moe.grouped_impl!r}: applies to the grouped matmuls "
                              f"of dispatch='ragged' or of mesh.expert=1 only {where}; set grouped_impl=auto")
        platform, devices = model_lib.target_platform(), math.prod(int(v) for v in sizes.values())
        if moe.grouped_impl == "megablox" and (platform == "gpu" or (platform != "tpu" and devices > 1)):
            raise ConfigError(f"config.model.moe.grouped_impl='megablox' on {platform} with {devices} device(s): "
                              f"a TPU kernel; elsewhere it runs in Pallas interpret mode (for CPU tests, on one "
                              f"device only: not inside a shard_map); use grouped_impl=auto or ragged_dot")
        for key in ("ep_buffer", "shared_experts", "capacity_factor", "balance_weight", "z_weight", "bias_rate",
                    "first_dense", "dense_d_ff"):
            if moe[key] < 0:
                raise ConfigError(f"config.model.moe.{key}={moe[key]}: must be >= 0")
        if moe.first_dense and (moe.dense_d_ff <= 0 or moe.dense_d_ff % tp):
            raise ConfigError(f"config.model.moe.dense_d_ff={moe.dense_d_ff}: first_dense={moe.first_dense} dense "
                              f"layers need a positive MLP width divisible by mesh.tensor={tp}")
        if moe.num_experts % ep:
            raise ConfigError(f"config.model.moe.num_experts={moe.num_experts}: not divisible by mesh.expert={ep}; "
                              f"use an expert size that divides it")
        if moe.d_ff_expert % tp:
            raise ConfigError(f"config.model.moe.d_ff_expert={moe.d_ff_expert}: not divisible by mesh.tensor={tp}")
        if moe.ep_buffer > 0 and not (moe.dispatch == "ragged" and ep > 1):
            raise ConfigError(f"config.model.moe.ep_buffer={moe.ep_buffer}: sizes the receive buffer of "
                              f"dispatch='ragged' across mesh.expert > 1 (here dispatch={moe.dispatch!r}, "
                              f"expert={ep}); set ep_buffer=0")
        if 0 < moe.ep_buffer < 1:
            raise ConfigError(f"config.model.moe.ep_buffer={moe.ep_buffer}: under 1 drops assignments even when "
                              f"the load is balanced; use 0 (dropless) or >= 1 (e.g. 2)")
        if moe.ff_chunks > 1:
            if not grouped:
                raise ConfigError(f"config.model.moe.ff_chunks={moe.ff_chunks}: applies to the grouped matmuls of "
                                  f"dispatch='ragged' or of mesh.expert=1 only {where}; set ff_chunks=1")
            if moe.d_ff_expert % (tp * moe.ff_chunks):
                raise ConfigError(f"config.model.moe.ff_chunks={moe.ff_chunks}: d_ff_expert={moe.d_ff_expert} / "
                                  f"mesh.tensor={tp} is not divisible by it; use a divisor")
        if moe.dispatch_chunks > 1:
            if ep == 1:
                raise ConfigError(f"config.model.moe.dispatch_chunks={moe.dispatch_chunks}: chunks apply to the "
                                  f"dispatch across mesh.expert > 1 only {where}; set dispatch_chunks=1")
            batch_ranks = sizes["data"] * sizes["fsdp"] * ep * sizes.get("replica", 1)  # DiLoCo replicas split it too
            mbs = config.pipeline.microbatches if sizes["pipe"] > 1 else config.train.microbatches
            rows = config.train.global_batch_size // max(1, mbs * batch_ranks)
            if rows % moe.dispatch_chunks:
                raise ConfigError(f"config.model.moe.dispatch_chunks={moe.dispatch_chunks}: does not divide the "
                                  f"{rows} rows per rank and microbatch (global_batch_size="
                                  f"{config.train.global_batch_size} / {mbs} microbatches / {batch_ranks} batch "
                                  f"ranks); use a divisor of {rows}")
        if (sizes["seq"] > 1 and m.seq_layout == "balanced" and moe.dispatch == "capacity"
                and moe.capacity_factor > 0):
            raise ConfigError(f"config.model.moe.capacity_factor={moe.capacity_factor} with model.seq_layout="
                              f"'balanced': capacity drops follow the row's token order, which the balanced layout "
                              f"scatters over the seq ranks; use capacity_factor=0 (dropless) or seq_layout=zigzag")
        if moe.dispatch == "ragged" and ep > 1 and model_lib.target_platform() == "cpu":
            raise ConfigError(f"config.model.moe.dispatch='ragged' with mesh.expert={ep} on cpu: "
                              f"jax.lax.ragged_all_to_all is not implemented on XLA:CPU; use "
                              f"moe.dispatch='capacity' with moe.capacity_factor=0 (dropless: capacity = all tokens "
                              f"of a row), or mesh.expert=1")
        llama.Llama.check_config(ml_collections.ConfigDict({**m.to_dict(), "d_ff": tp, "mlp_chunks": 1}), sizes,
                                 config)  # heads, dims

    def __init__(self, config, rngs: nnx.Rngs):
        cfg = _llama_config(config)
        self.cfg = cfg
        self.embedding = llama._param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)
        moe = _settings(config)
        self.remat = config.remat
        if moe.first_dense:
            dense = dataclasses.replace(cfg, num_layers=moe.first_dense, d_ff=moe.dense_d_ff)
            self.dense_blocks = llama.Blocks(dense, rngs)
        self.blocks = MoEBlocks(cfg, moe, rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,)), logical=("norm",))
        self.head = llama._param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    logits = llama.Llama.logits

    def embed(self, batch, par: Parallelism = DENSE):
        """Token embedding, then the dense first layers if any: tokens [B, T] -> [B, T, D] (split as Llama)."""
        x = llama.Llama.embed(self, batch, par)
        if hasattr(self, "dense_blocks"):
            graphdef, stacked = nnx.split(self.dense_blocks)
            x = apply_blocks(graphdef, nnx.to_pure_dict(stacked), x, batch, self.remat, par)
        return x

    @staticmethod
    def flops_per_token(m, seq_len, params, logical) -> float:
        """The active parameters: 6 per parameter but the embedding table, routed experts counted top_k /
        num_experts; plus attention in every layer (the dense first ones too)."""
        moe = m.moe
        layers = m.num_layers + moe.first_dense
        return (param_flops_per_token(params, logical, fraction={"experts": moe.top_k / moe.num_experts})
                + attention_flops_per_token(layers, m.num_heads, m.head_dim or m.d_model // m.num_heads, seq_len))

    @staticmethod
    def aux_metrics(model_config, aux, weight_total) -> dict:
        load = aux["load"]  # (L, E) global assignments per expert
        layers, experts = load.shape
        rel = load / jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)  # 1 = uniform
        return dict(aux_loss=jnp.sum(aux["loss"]) / weight_total,
                    balance_loss=jnp.sum(aux["balance"]) / weight_total / layers,
                    z_loss=jnp.sum(aux["z"]) / weight_total / layers,
                    load_min=jnp.min(rel), load_max=jnp.max(rel), load_cv=jnp.mean(jnp.std(rel, axis=-1)),
                    dropped=jnp.sum(aux["dropped"]) / jnp.maximum(jnp.sum(aux["assignments"]), 1.0))

    @staticmethod
    def after_step(model_config, params, aux) -> dict:
        """Aux-loss-free balancing: bias += rate * sign(mean load - load), per layer, from the step's load."""
        rate = float(model_config.moe.bias_rate)
        if not rate:
            return params
        load = aux["load"]  # (L, E)
        blocks = dict(params["blocks"])
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        blocks["router_bias"] = params["blocks"]["router_bias"] + step
        return {**params, "blocks": blocks}
