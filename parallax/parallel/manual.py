"""The manual region: a model's loss run per rank inside one fully manual `jax.shard_map`.

Owns `Parallelism`, the static description (mesh sizes, rules, attention kind) that model code consults at
its few parallel points, and `shard_loss`, which wraps a loss in the shard_map. Inside the region every
array is this rank's piece:

    tokens, targets, weights, segment ids, positions   [B/dp, T/s]          (batch over data/fsdp/expert)
    residual stream between blocks                     [B/dp, T/(s*t), D]   (sequence also over `tensor`)
    weights named heads / kv_heads / mlp               split over `tensor` (the rules table)
    weights named vocab (embedding, head)              vocabulary split over `tensor`

For a transformer block (the models in `models/` are examples) that means, per layer: norm on the sharded
stream, `gather_seq` (all-gather over `tensor`), column-parallel q/k/v, local
heads attend (`dense` when seq == 1, else Ulysses all-to-alls, ring collective-permutes or one all-gather
of k|v over `seq`), row-parallel out projection, `scatter_seq` (reduce-scatter over `tensor`); the MLP the
same way. The loss is the vocabulary-parallel cross-entropy sum, summed over `seq` and the batch axes. With
ring or all-gather attention each rank's tokens are the zigzag chunks i and 2s-1-i instead of chunk i:
positions carry causality and the loss is a sum over tokens, so a permutation of the sequence changes
nothing else. The batch then enters the region whole along T (one small all-gather of the int/weight arrays
per step) and each rank cuts its own two chunks; the pipeline lays the batch out before its region instead
(`parallax.steps.pipeline`).

Why every axis is manual, data and fsdp too: with a partially manual shard_map (data / fsdp automatic),
XLA's partitioner all-gathers the batch over `data` around every manual collective, so each data rank
would run the whole batch. So FSDP is explicit here as well: a weight dimension the rules shard over
`fsdp` (or any axis but `tensor`) is all-gathered right before use, one layer at a time inside the layer
scan (`unshard`); autodiff turns that into the reduce-scatter of its gradient (ZeRO-3). Parameters
replicated over a manual axis (every weight over `data` and `seq`, norms over `tensor`) are cast to
varying over it at the region's entry, so their gradient reduction (the transpose of the cast, a psum)
runs once on the stacked weights at the boundary, not once per layer inside the scan.

Expert parallelism (a model that declares "expert", `parallax.parallel.expert`): weights named `experts`
stay split over `expert` (each rank holds E/ep experts, never gathered), the batch is split over `expert`
like a data axis, and the MoE layer moves tokens to their experts' ranks and back with two all-to-alls.

With tensor == seq == expert == 1 the model runs its dense code (`DENSE`) under the compiler's sharding
instead.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types

from absl import logging
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from parallax import compat
from parallax.parallel import cudnn, flash, sequence, splash, tensor, vocab
from parallax.parallel.region import SINGLE, Region, vary
from parallax.sharding import (activation_context, constrain, is_logical_names, logical_to_spec, param_logical_names,
                               spec_axes)

# The model axes: what the manual region's code splits activations over.
MODEL_AXES = ("seq", "tensor")
# Axes whose parameter shards the model uses as they are; a weight sharded over any other axis is gathered,
# `seq` included: rules such as embed -> (fsdp, seq) shard the weights, their gradients and optimizer state over
# the seq ranks too (ZeRO over the context ranks, as MaxText's rules and Megatron's distributed optimizer do),
# gathered one layer at a time like FSDP's shards.
WEIGHT_AXES = ("tensor",)
# ... and a dim named `experts` keeps its split over `expert`: each expert rank computes with its own experts.
# Another dim sharded over `expert` (e.g. rules embed -> (fsdp, expert): ZeRO over the expert ranks too) is
# gathered like FSDP.
EXPERT_AXES = {"experts": "expert"}
# The name of gathered weights: `apply_blocks` never saves them for the backward (it gathers them again), or
# every layer's full weights would stay live until the backward, undoing FSDP.
GATHERED = "parallax_fsdp_gathered"



def _per_batch_rows(fn, *batched):
    """`fn(*batched)` (arrays with a leading batch dim) per batch shard when the compiler shards the step
    (the dense path's `activation_sharding`): a shard_map over every axis, rows split over the batch axes.
    A Pallas kernel is one custom call the compiler cannot partition, so left to it every device would run the
    whole batch. Inside a manual region (no context) the arrays are already local: `fn` as it is, through
    `compat.kernel_call` (the region checks varying axes, and the kernels' outputs carry none)."""
    ctx = activation_context()
    spec = logical_to_spec(("batch",), ctx[1], ctx[0]) if ctx is not None else P()
    if not len(spec) or spec[0] is None:
        return compat.kernel_call(fn, *batched)
    rows = P(spec[0])
    # check_vma off: Pallas outputs carry no varying-axes annotation; every input and the output are split
    # the same way over the batch axes and nothing is replicated, so no transpose needs a psum.
    return jax.shard_map(fn, mesh=ctx[0], in_specs=(rows,) * len(batched), out_specs=rows,
                         check_vma=False)(*batched)


def _lookup_by_embed_shards(table, names, tokens, dtype):
    """The embedding lookup on the compiler-sharded path when FSDP splits the table's model dim (`embed`)
    over batch axes and nothing splits its vocabulary: None otherwise (the caller gathers the table).

    Gathering the table costs a whole [V, D] fp32 copy per device and a whole fp32 gradient before its
    reduce-scatter (Llama 3's 128,256 x 4096 table: 2 GiB each). Instead, in a `shard_map`, each device
    all-gathers the token ids of its FSDP group (ints, small), looks them up in its own [V, D/f] columns,
    casts to `dtype`, and one all-to-all over the group hands every device its own rows' whole vectors: the
    bytes of the output, and the gradient is scatter-added into the device's fp32 columns (the fp32
    accumulation of the gathered path, without a whole table)."""
    ctx = activation_context()
    if ctx is None:
        return None
    mesh, rules = ctx
    spec = logical_to_spec(names, rules, mesh)
    rows = logical_to_spec(("batch",), rules, mesh)
    batch_axes = spec_axes(rows[0]) if len(rows) else ()
    vocab_axes = spec_axes(spec[0]) if len(spec) > 0 else ()
    embed_axes = spec_axes(spec[1]) if len(spec) > 1 else ()
    if vocab_axes or not embed_axes or not set(embed_axes) <= set(batch_axes):
        return None
    if tokens.shape[0] % math.prod(mesh.shape[a] for a in batch_axes):
        return None

    def per_shard(table, tokens):  # table [V, D/f], tokens [B/n, T] -> [B/n, T, D]
        ids = jax.lax.all_gather(tokens, embed_axes, axis=0, tiled=True)  # (f B/n, T): the group's rows
        cols = jnp.take(table, ids, axis=0).astype(dtype)  # (f B/n, T, D/f)
        # Row block j to group member j; the members' column blocks concatenated along D, in mesh order
        # (all_gather / all_to_all over several axes both order them major to minor, as the spec does).
        return jax.lax.all_to_all(cols, embed_axes, split_axis=0, concat_axis=2, tiled=True)

    out = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(None, spec[1]), P(rows[0])),
                        out_specs=P(rows[0]))(table, tokens)
    return constrain(out, ("batch", "length", "act_embed"))


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How the manual region splits the model. `DENSE` (the default) means no region: plain dense code.

    `mesh_shape` and `rules` are ((name, value), ...) tuples so the description stays immutable.
    `attention_block` and `loss_chunk` (`config.model` keys of the same names) bound the two big
    activations of a language model; they apply with or without a region.
    """

    tensor: int = 1
    seq: int = 1
    expert: int = 1  # expert parallelism (a model declaring "expert"); else the axis is a batch axis only
    attention_kind: str = "dense"  # dense | ulysses | ring | usp | allgather
    mesh_shape: tuple = ()
    rules: tuple = ()
    attention_block: int = 512  # blockwise attention tile (0: the reference, [T, T] logits)
    loss_chunk: int = 1024  # sequence positions per cross-entropy chunk (0: the whole sequence at once)
    platform: str | None = None  # of the devices compiled for (the plan's); None: the host's backend
    attention_impl: str = "blockwise"  # the local attention kernel: blockwise | splash | cudnn (the plan resolves auto)
    decoding: bool = False  # generating (parallax.generate), not training: e.g. a router may route every token
    vocab_axes: tuple = ()  # the head's vocabulary split over these axes (pipeline.vocab_parallel: pipe, tensor)
    seq_layout: str = "zigzag"  # all-gather attention's rows over seq: zigzag | balanced (`sequence.balanced_order`)
    ulysses: int = 0  # usp: seq ranks per Ulysses group (the plan resolves model.ulysses_degree; divides seq)
    quant: object = None  # parallax.quant.QuantSettings: `dot` in 8 bits (config.quant); None: the compute dtype

    @property
    def manual(self) -> bool:
        return self.tensor > 1 or self.seq > 1 or self.expert > 1

    def spec(self, names) -> P:
        return logical_to_spec(names, dict(self.rules), types.SimpleNamespace(shape=dict(self.mesh_shape)))

    def param_specs(self, logical):
        """A params tree of logical names -> the tree of their PartitionSpecs (`spec` of each)."""
        return jax.tree.map(self.spec, logical, is_leaf=is_logical_names)

    def unshard(self, w, names, dtype=None):
        """All-gathers the dims of weight `w` (logical `names`) sharded over non-model axes, e.g. FSDP's
        `embed -> fsdp` (or `(fsdp, seq)`); the `tensor` split stays. Identity for `DENSE`. Its gradient is a
        reduce-scatter.
        With `dtype` the shard is cast first, so the gather moves (and the layer holds) `dtype` bytes; the
        gradient is still reduce-scattered in fp32 and cast back (`_gather_cast`)."""
        w_dtype = jnp.dtype(w.dtype)  # the gradient's dtype, however many dims are gathered
        for dim, entry in enumerate(self.spec(names) if self.mesh_shape else ()):
            kept = (*WEIGHT_AXES, EXPERT_AXES.get(names[dim]))
            gather = tuple(a for a in spec_axes(entry) if a not in kept)
            if gather:
                w = checkpoint_name(_gather_cast(w, gather, dim, jnp.dtype(dtype or w.dtype), w_dtype), GATHERED)
        return w if dtype is None else w.astype(dtype)

    def weight(self, var, dtype=None):
        """The value of parameter `var` as this rank uses it: FSDP shards gathered (`unshard`), the `tensor`
        split kept, cast to `dtype` if given (before the gather: half the bytes moved for bf16). Inside the
        layer scan `var` is one layer's slice, so its leading `layers` name is dropped."""
        value = var[...]
        names = tuple(var.get_metadata()["logical"])
        return self.unshard(value, names[len(names) - value.ndim:], dtype)

    def dot(self, spec, x, var, dtype=None):
        """A projection: `einsum(spec, x, weight(var, dtype))`, spec 'x,w->out' in single letters (e.g.
        'btd,dhk->bthk'), x the activation and `var` the weight parameter. With `quant` (config.quant) the
        operands are 8-bit (`parallax.quant.dot`: scales taken across the ranks that split a contracting dim,
        FSDP shards quantized before their gather); x must then be in the compute dtype."""
        return self.projection(var, dtype)(spec, x)

    def projection(self, var, dtype=None):
        """`dot` by `var` as a function `(spec, x) -> y`, for a loop that projects by the same weight every
        step (a chunked MLP): the weight is gathered once, here; with `quant` its 8-bit gather runs per call
        (inside the quantized dot's custom VJP, which gathers again in the backward)."""
        if self.quant is None:
            w = self.weight(var, dtype)
            return lambda spec, x: jnp.einsum(spec, x, w)
        from parallax import quant
        value = var[...]
        names = tuple(var.get_metadata()["logical"])
        names = names[len(names) - value.ndim:]
        return lambda spec, x: quant.dot(x, value, self.quant, self._quant_layout(spec, names))

    def _quant_layout(self, spec, names):
        """Which mesh axes split the contracting and output dims of a weight of logical `names` here, and
        which of its dims `unshard` would gather (`parallax.quant.Layout`)."""
        from parallax import quant
        layout = quant.Layout(spec)
        if not self.mesh_shape:
            return layout
        _, wl, _, contract = layout.letters()
        gather, k_axes, w_k_axes, n_axes = [], [], [], []
        for dim, entry in enumerate(self.spec(names)):
            kept = (*WEIGHT_AXES, EXPERT_AXES.get(names[dim]))
            axes = spec_axes(entry)
            if any(a not in kept for a in axes):
                gather.append((dim, tuple(a for a in axes if a not in kept)))
            if wl[dim] in contract:
                w_k_axes += axes
                k_axes += [a for a in axes if a in kept]
            else:
                n_axes += [a for a in axes if a in kept]
        return dataclasses.replace(layout, k_axes=tuple(k_axes), w_k_axes=tuple(w_k_axes), n_axes=tuple(n_axes),
                                   gather=tuple(gather))

    def gathered(self, module):
        """`module` with each parameter outside `blocks` gathered once (`unshard`), to be used with
        `model_axes_only()`: for a loop that reads the same weights every step (the chunked loss), so the
        gather and its gradient's reduce-scatter run once, not once per chunk. Identity without a region."""
        if not self.mesh_shape:
            return module
        graphdef, state = nnx.split(module)
        values, names = nnx.to_pure_dict(state), param_logical_names(state)
        values = {k: v if k == "blocks" else jax.tree.map(self.unshard, v, names[k]) for k, v in values.items()}
        return nnx.merge(graphdef, values)

    def experts(self, h, idx, gates, ws, names, dispatch):
        """A MoE layer's routed SwiGLU experts on this rank's tokens (`parallax.parallel.moe.routed_experts`):
        the dispatch (capacity or dropless, over `expert` or not, rows split over `seq` or not) is the
        library's; the model gives its tokens, choices, gates and expert weights (`par.weight`'s)."""
        from parallax.parallel import moe  # it reads this module's `log_once`
        return moe.routed_experts(self, h, idx, gates, ws, names, dispatch)

    def row_length(self, local: int) -> int:
        """Tokens in a whole row, from this rank's `local` part of it (a row is split over `seq`)."""
        return local * self.seq

    def sum_row(self, tree):
        """Per-row values (e.g. [B, E] sums over this rank's part of each row) summed over the ranks holding
        the rows' other parts (`seq`): whole-row values, the same on each of them."""
        return jax.lax.psum(tree, "seq") if self.seq > 1 else tree

    def gather_seq(self, x):
        """[B, T/(s*t), D] -> [B, T/s, D] (all-gather over `tensor`); identity when tensor == 1."""
        return tensor.gather_seq(x, platform=self.platform) if self.tensor > 1 else x

    def scatter_seq(self, y):
        """Partial sums [B, T/s, D] -> [B, T/(s*t), D] (reduce-scatter over `tensor`); identity when tensor == 1."""
        return tensor.scatter_seq(y, platform=self.platform) if self.tensor > 1 else y

    def split_seq(self, x):
        """[B, T/s, ...] -> this tensor rank's [B, T/(s*t), ...] (a slice, no communication); identity when
        tensor == 1. For per-token values every tensor rank computes whole, e.g. learned position embeddings."""
        if self.tensor == 1:
            return x
        n = x.shape[1] // self.tensor
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("tensor") * n, n, axis=1)

    def embed(self, table_param, tokens, dtype):
        """Token embedding lookup in the table `table_param` (an nnx.Param [V, D]): tokens [B, T/s] -> the
        residual stream [B, T/(s*t), D] in `dtype`.

        With tensor > 1 the table is split over the vocabulary ([V/t, D] per rank) and the ranks' rows are
        combined with one reduce-scatter along the sequence (`vocab.vocab_parallel_embed`). Otherwise rows
        are taken from the fp32 table and cast, so the table's gradient is accumulated in fp32."""
        table = self.weight(table_param)
        if self.vocab_axes:  # pipeline.vocab_parallel: this rank's share; the executor sums it over `pipe`
            return vocab.vocab_parallel_embed_partial(table.astype(dtype), tokens, axis_name=self.vocab_axes,
                                                      platform=self.platform)
        if self.tensor > 1:
            return vocab.vocab_parallel_embed(table.astype(dtype), tokens, platform=self.platform)  # (B, T/(s*t), D)
        looked_up = _lookup_by_embed_shards(table, tuple(table_param.get_metadata()["logical"]), tokens, dtype)
        if looked_up is not None:
            return looked_up
        table = constrain(table, ("vocab", None))  # gather FSDP shards of the table before the lookup
        return constrain(jnp.take(table, tokens, axis=0).astype(dtype), ("batch", "length", "act_embed"))

    def attention(self, q, k, v, segment_ids, positions, *, window=None, softcap=None, windowed=None):
        """Causal attention within packed documents on this rank's heads: dense when seq == 1, else Ulysses,
        ring, usp (Ulysses x ring) or all-gather over `seq`. q [B, T/s, H/t, Dh]; k, v [B, T/s, K/t, Dh] (H % K == 0) ->
        [B, T/s, H/t, Dh]. Per-call static options (`sequence.attention_options`): `window` W > 0, a sliding
        window (a query at position p sees its document's keys at p - W + 1 .. p); `softcap` c > 0, the
        scaled logits capped to c * tanh(s / c) before the mask and softmax. Every kind and kernel has them
        but cudnn the soft cap (the plan refuses it, from the model's `attention_options`).

        `windowed`: a traced boolean scalar (e.g. a per-layer flag of a stacked parameter) saying whether
        `window` applies in this call: layers alternating local and global attention inside one scanned
        stack. The call is then a `lax.cond` between the two static variants (each compiled once; only the
        taken one runs)."""
        if windowed is not None:
            def variant(w):
                return lambda *a: self.attention(*a, window=w, softcap=softcap)
            return jax.lax.cond(windowed, variant(window), variant(None), q, k, v, segment_ids, positions)
        opts = dict(zip(("window", "softcap"), sequence.attention_options(window, softcap)))
        if self.seq == 1:
            return self._attend(q, k, v, segment_ids, segment_ids, positions, positions, **opts)
        if self.attention_kind == "ulysses":
            return sequence.ulysses_attention(q, k, v, segment_ids, positions, axis_name="seq", attend=self._attend,
                                              **opts)
        grouped = dict(self.mesh_shape).get("pipe", 1) > 1  # ring inside pipeline stages: `grouped_shift`
        shifts = "; k|v shifted by all-to-alls within each stage's seq ranks)" if grouped else ")"
        if self.attention_kind == "ring":
            log_once("attention kernel: ring (online softmax per zigzag chunk pair, rematerialised" + shifts)
            return sequence.ring_attention(q, k, v, segment_ids, positions, axis_name="seq", grouped=grouped, **opts)
        if self.attention_kind == "usp":
            u = self.ulysses or self.seq
            log_once(f"attention kernel: usp (Ulysses over groups of {u} seq ranks x ring over {self.seq // u} "
                     "groups; online softmax per zigzag chunk pair" + shifts)
            return sequence.usp_attention(q, k, v, segment_ids, positions, axis_name="seq", ulysses=u,
                                          grouped=grouped, attend=self._attend, **opts)
        if self.attention_kind == "allgather":
            return sequence.allgather_attention(q, k, v, segment_ids, positions, axis_name="seq", attend=self._attend,
                                                platform=self.platform, zigzag=not self.balanced, **opts)
        raise ValueError(f"attention={self.attention_kind!r} cannot run on seq={self.seq}: use 'ulysses', 'ring', "
                         f"'usp' or 'allgather'")

    def _attend(self, q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, window=0, softcap=0.0):
        """Full-sequence attention on local heads: splash (`attention_impl`), blockwise (`attention_block` > 0)
        or the reference; `window` / `softcap` as `attention` takes them."""
        opts = dict(window=window, softcap=softcap)
        if self.attention_impl == "splash":
            mode = "Mosaic kernel" if (self.platform or jax.default_backend()) == "tpu" else "Pallas interpret mode"
            log_once(f"attention kernel: splash ({mode}, {min(self.attention_block or 512, q.shape[1])}-token "
                      f"tiles; parallax.parallel.splash)")
            fn = functools.partial(splash.splash_attention, platform=self.platform, block=self.attention_block, **opts)
            return _per_batch_rows(fn, q, k, v, q_segment_ids, kv_segment_ids)
        if self.attention_impl == "cudnn":
            where = "cuDNN" if (self.platform or jax.default_backend()) == "gpu" else "jax.nn's XLA implementation"
            log_once(f"attention kernel: cudnn (jax.nn.dot_product_attention, {where}; parallax.parallel.cudnn)")
            return cudnn.cudnn_attention(q, k, v, q_segment_ids, kv_segment_ids, platform=self.platform, **opts)
        if self.attention_block:
            log_once(f"attention kernel: blockwise, {self.attention_block}-token tiles (parallax.parallel.flash)")
            return flash.blockwise_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                                             block=self.attention_block, **opts)
        log_once("attention kernel: reference ([T, T] logits; model.attention_block=0)")
        return sequence.attention_reference(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                                            **opts)

    def chunked(self, fn, x, batch):
        """sum over sequence chunks of `fn(x_chunk, batch_chunk)`, each chunk rematerialised in the backward.

        For a loss whose intermediates are big per token (the logits): only one chunk of them is live, in
        the forward and in the backward. x is this rank's [B, T/(s*t), ...] stream, batch arrays [B, T/s].
        A chunk is about `loss_chunk` positions of [B, T/s] (after `gather_seq`): the local length is cut
        into n = ceil(T/(s*t) / (loss_chunk/t)) equal chunks, padded at the end with weight-0 positions when
        n does not divide it. With tensor > 1, chunk j of x gathered over `tensor` is rank r's positions
        j*c.. of its slice for every r, so the batch chunk is the same positions of each rank's slice.
        `fn` must treat tokens independently (norm + head + cross-entropy do) and return a sum.
        """
        t, tl = self.tensor, x.shape[1]
        want = max(1, self.loss_chunk // t)  # positions of x per chunk
        if not self.loss_chunk or want >= tl:
            return fn(x, batch)
        n = -(-tl // want)
        c = -(-tl // n)
        pad = n * c - tl

        def split(a, per_rank):  # [B, per_rank * tl, ...] -> [n, B, per_rank * c, ...], padded with zeros
            a = a.reshape(a.shape[0], per_rank, tl, *a.shape[2:])
            a = jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))  # weights 0: no loss
            a = a.reshape(a.shape[0], per_rank, n, c, *a.shape[3:])
            return jnp.moveaxis(a, 2, 0).reshape(n, a.shape[0], per_rank * c, *a.shape[4:])

        def one(_, xs):
            return None, fn(*xs)
        one = jax.checkpoint(one, policy=jax.checkpoint_policies.nothing_saveable)
        _, sums = jax.lax.scan(one, None, (split(x, 1), jax.tree.map(lambda a: split(a, t), batch)))
        return sums.sum()

    def cross_entropy(self, logits, batch):
        """Weighted cross-entropy summed over this rank's tokens (not yet over the batch axes or `seq`):
        vocabulary-parallel over `tensor` (logits [B, T/s, V/t]; the full value on every tensor rank),
        dense otherwise (logits [B, T, V]). The caller divides by the global weight total."""
        if self.vocab_axes:  # the vocabulary over `pipe` too (pipeline.vocab_parallel): rank pipe * t + tensor
            return vocab.vocab_parallel_cross_entropy(logits, batch["targets"], batch["weights"],
                                                      axis_name=self.vocab_axes)
        if self.tensor > 1:
            return vocab.vocab_parallel_cross_entropy(logits, batch["targets"], batch["weights"])
        return vocab.cross_entropy_sum(logits, batch["targets"], batch["weights"])

    def sum_tokens(self, x):
        """Sums a per-rank token statistic over the ranks holding other tokens (batch axes and `seq`)."""
        batch = self.spec(("batch",))
        axes = (spec_axes(batch[0]) if len(batch) else ()) + (("seq",) if self.seq > 1 else ())
        return jax.lax.psum(x, axes) if axes else x

    def sum_aux(self, aux):
        """Per-rank sums of per-token statistics (a layer's aux values) -> global sums on every rank: summed
        over the ranks holding other tokens (`sum_tokens`), averaged over `tensor`, whose ranks computed
        the same value from the same gathered tokens. Identity without a region."""
        if not self.mesh_shape:
            return aux
        aux = jax.tree.map(self.sum_tokens, aux)
        return jax.tree.map(lambda a: jax.lax.pmean(a, "tensor"), aux) if self.tensor > 1 else aux

    def model_axes_only(self) -> "Parallelism":
        """This description for weights that are whole over every axis but `seq` / `tensor`: the pipeline's
        first / last parts (the compiler gathers their FSDP shards once per step, outside the region), and
        weights already `gathered`.
        `spec` then names only those axes and `unshard` is the identity; `sum_tokens` is not for it. A weight
        rule naming `seq` (ZeRO over the seq ranks, `WEIGHT_AXES`) is dropped here: those weights are whole over
        `seq` too; only `length` (activations) keeps it."""
        def whole_over_seq(name, axes):
            return axes if name == "length" else (tuple(a for a in spec_axes(axes) if a != "seq") or None)
        return dataclasses.replace(
            self, mesh_shape=tuple((a, n if a in MODEL_AXES else 1) for a, n in self.mesh_shape),
            rules=tuple((name, whole_over_seq(name, axes)) for name, axes in self.rules))

    @property
    def piece_order(self):
        """The static layout of each row over `seq` as a `sequence.pieces_layout` order (rank i holds pieces
        order[i*n/s : (i+1)*n/s] of the n equal pieces of the row): zigzag for ring and all-gather
        attention, `sequence.usp_order` for usp, None for a row split in order (Ulysses) or `balanced`
        (an order per row, from the batch)."""
        if self.seq == 1 or self.balanced:
            return None
        if self.attention_kind in ("ring", "allgather"):
            return sequence.zigzag_order(self.seq)
        if self.attention_kind == "usp":
            order = sequence.usp_order(self.seq, self.ulysses or self.seq)
            return None if order == tuple(range(len(order))) else order
        return None

    @property
    def balanced(self) -> bool:
        """All-gather attention with `seq_layout=balanced`: each rank's tokens are pieces of equal causal
        work (`sequence.balanced_order`), per row, from the batch's segment ids and positions."""
        return self.attention_kind == "allgather" and self.seq > 1 and self.seq_layout == "balanced"

    @property
    def reordered(self) -> bool:
        """Whether each seq rank's tokens are not simply its contiguous T/s of the row (`laid_out`)."""
        return self.balanced or self.piece_order is not None

    def laid_out(self, batch: dict) -> dict:
        """[B, T] batch arrays in the order whose contiguous split over `seq` gives each rank its tokens:
        `piece_order` or balanced (identity otherwise)."""
        if self.balanced:
            t = batch["segment_ids"].shape[1]
            order = sequence.balanced_order(batch["segment_ids"], batch["positions"], self.seq,
                                            sequence.balanced_chunks(t // self.seq, self.attention_block))
            return jax.tree.map(lambda a: jnp.take_along_axis(a, order, axis=1), batch)
        if self.piece_order is not None:
            return jax.tree.map(lambda a: sequence.pieces_layout(a, self.piece_order, axis=1), batch)
        return batch

    def local_sequence(self, batch: dict) -> dict:
        """When `reordered`: [B, T] batch arrays -> this rank's [B, T/s] of `laid_out`."""
        if not self.reordered:
            return batch
        rank = jax.lax.axis_index("seq")

        def mine(a):
            return jax.lax.dynamic_slice_in_dim(a, rank * (a.shape[1] // self.seq), a.shape[1] // self.seq, 1)
        return jax.tree.map(mine, self.laid_out(batch))


DENSE = Parallelism()


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_cast(w, axes, dim, dtype, w_dtype):
    """all_gather(w.astype(dtype)) over `axes` along `dim`; the gradient is reduce-scattered in fp32 and
    returned in w's dtype `w_dtype` (a bf16 reduction over many ranks would lose the small gradients)."""
    return jax.lax.all_gather(w.astype(dtype), axes, axis=dim, tiled=True)


def _gather_cast_fwd(w, axes, dim, dtype, w_dtype):
    return _gather_cast(w, axes, dim, dtype, w_dtype), None


def _gather_cast_bwd(axes, dim, dtype, w_dtype, _, g):
    scattered = jax.lax.psum_scatter(g.astype(jnp.float32), axes, scatter_dimension=dim, tiled=True)
    return (scattered.astype(w_dtype),)  # w_dtype: the original weight's (fp32), also for a second gathered dim


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)

_LOGGED: set[str] = set()


def log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.info(message)


def _vary(x, spec: P, mesh, region: Region):
    """Casts a parameter replicated over some mesh axes to varying over them (grad psum at the boundary)."""
    used = {a for entry in spec for a in spec_axes(entry)} | set(region.copies)  # copies share no gradient
    return vary(x, tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in used))


def shard_loss(loss_fn, par: Parallelism, mesh, param_logical, region: Region = SINGLE):
    """Wraps `loss_fn(params, batch) -> scalar` (or a pytree of them, each reduced over every axis) so it
    runs per rank in a shard_map manual over every axis.

    `param_logical` is the params tree of logical names; the parameter in_specs are `par.spec` of them
    (heads / kv_heads / mlp / vocab -> tensor, embed -> fsdp, ...). Batch arrays [B, T] are split by the
    `batch` and `length` rules. `loss_fn` gets params still sharded over FSDP (the model calls
    `par.unshard` where it uses a weight) and must return a value reduced over all axes (`par.sum_tokens`).

    `region` (`parallax.parallel.region`): with copies (DiLoCo's `replica`), every parameter has a leading
    [R] dim split over the copy axis, the batch rows are split over it first, and each output gains a
    leading [R] dim: copy r's value, from its own parameters and rows. No collective runs over it.
    """
    one = par.param_specs(param_logical)
    param_specs = jax.tree.map(region.param_spec, one, is_leaf=lambda s: isinstance(s, P))
    batch_spec = region.rows_spec(par.spec(("batch", None if par.reordered else "length")))

    def per_rank(params, batch):
        params = jax.tree.map(lambda p, s: _vary(p, s, mesh, region), region.own(params), one)
        return region.tagged(loss_fn(params, par.local_sequence(batch)))

    return jax.shard_map(per_rank, mesh=mesh, in_specs=(param_specs, batch_spec), out_specs=region.param_spec(P()),
                         axis_names=set(mesh.axis_names))
