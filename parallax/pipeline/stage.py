"""A chunk of layers as the executor runs it on one rank: forward with stored residuals, and the backward
rebuilt from them, fused (BW) or split into B and W.

A chunk is a sequence of layers: with `layer_fn` the executor scans the chunk's layers itself (the
leaves' leading dim), one vjp per layer, so the backward can be split per layer (`Stage.backward`); with
`stage_fn` alone the chunk is one opaque "layer" and nothing changes but the names. The weights are
arguments of every method (the executor passes the version an action uses), never state of the stage.

What is stored between F and B is a layer's pullback without what the backward can fetch again: `probe`
traces one layer's pullback once and sorts its leaves into the weights and microbatch inputs (fetched
again), constants, and real residuals (stored in the slot, stacked over the chunk's layers).

An uneven layout (`Schedule.layers`) pads every chunk to the largest stage's layer count; the methods then
take `active`, one flag per layer slot of the chunk, and run each slot under a `lax.cond`: a padding slot
passes the residual stream (or its cotangent) through and returns zeros for the rest, and its layer's
work is skipped at run time, so a stage of fewer layers takes less time. The cond wraps a whole layer's
forward, B or W, so the backward's B / W split (`split.py`) stays per layer.
"""
import jax
import jax.numpy as jnp

from parallax.compat import varying_axes as vma
from parallax.parallel.region import vary
from parallax.pipeline.layout import to_memory_of, zeros
from parallax.pipeline.split import SplitBackward


def _zeros_as(aval):
    """Zeros of an abstract value's shape, dtype and varying axes (`jax.eval_shape`'s output)."""
    return zeros(jax.ShapeDtypeStruct(aval.shape, aval.dtype), axes=tuple(aval.manual_axis_type.varying))


class Stage:
    """One rank's view of its chunks: `layer_fn(w, x, mb) -> y`, or with `stage_aux`,
    `-> (y, (aux loss, stats))`; `chunk0` is one chunk's weights (shapes and types), `x0` / `mb0` a
    residual-stream value and a microbatch's inputs (shapes and types). `stats_axes`: the axes stats are
    typed varying over (this rank's sums, reduced by the executor)."""

    def __init__(self, layer_fn, chunk0, x0, mb0, *, layered, stage_aux, remat, forward_only, split_w, stats_axes):
        self.layer_fn, self.layered, self.stage_aux = layer_fn, layered, stage_aux
        self.remat, self.forward_only, self.stats_axes = remat, forward_only, stats_axes
        # Per-layer weight gradients in W (see `backward`): B stores each layer's output cotangent.
        self.split_w = split_w and layered and not remat and not forward_only
        self.num_layers = jax.tree.leaves(chunk0)[0].shape[0] if layered else 1
        self.x0 = x0
        w0 = self.layer(chunk0, 0)
        self.term0, self.stats0 = None, ()
        if stage_aux and not forward_only:  # probes: only their types are used
            _, self.term0, stats = self.apply(w0, x0, mb0)
            self.stats0 = self.stack_like(stats)  # a chunk's stats: stacked over its layers
        self.res_avals, self.roles, self.treedef = [], [], None
        if not forward_only:
            self.probe(w0, x0, mb0)

    def layer(self, w, i):
        """Layer i's weights of chunk weights w (the chunk itself when it is one opaque layer)."""
        return jax.tree.map(lambda a: a[i], w) if self.layered else w

    def stack_like(self, tree):
        """Zeros like `tree` (same types), stacked over the chunk's layers (unstacked for an opaque chunk)."""
        lead = (self.num_layers,) if self.layered else ()
        return jax.tree.map(lambda a: to_memory_of(a, zeros(jax.ShapeDtypeStruct(lead + a.shape, a.dtype),
                                                             axes=vma(a))), tree)

    def over_layers(self, fn, carry, xs, reverse=False, active=None):
        """`lax.scan(fn, carry, xs)` over the chunk's layers; one call of fn on the whole chunk when opaque.
        With `active` (bool per layer slot), `fn` runs only on the active slots: the others pass the carry
        through and return zeros (`fn` must not change the carry's type)."""
        if self.layered:
            if active is None:
                return jax.lax.scan(fn, carry, xs, reverse=reverse)

            def step(c, xs_on):
                xs, on = xs_on
                out = jax.eval_shape(fn, c, xs)
                return jax.lax.cond(on, fn, lambda c, _: (c, jax.tree.map(_zeros_as, out[1])), c, xs)
            return jax.lax.scan(step, carry, (xs, active), reverse=reverse)
        if active is not None:
            raise ValueError("an uneven layout needs the executor's layer_fn (one layer), not a stage_fn")
        return fn(carry, xs)

    def apply(self, w, x, mb):
        """One layer: layer_fn -> (y, aux loss term or None, stats or ())."""
        out = self.layer_fn(w, x, mb)
        if not self.stage_aux:
            return out, None, ()
        y, (term, stats) = out
        return y, term.astype(jnp.float32), jax.tree.map(lambda a: vary(jax.lax.stop_gradient(a), self.stats_axes),
                                                         stats)

    def vjp_layer(self, w, x, mb):
        """-> (y, pullback, aux loss term, stats). With stage aux values the pullback takes (dy, d term)
        (`seed`) and the term's gradient flows into dw and dx with the activations'."""
        if not self.stage_aux:
            y, pb = jax.vjp(lambda w, x: self.layer_fn(w, x, mb), w, x)
            return y, pb, None, ()

        def f(w, x):
            y, term, stats = self.apply(w, x, mb)
            return (y, term), stats
        (y, term), pb, stats = jax.vjp(f, w, x, has_aux=True)
        return y, pb, term, stats

    def seed(self, dy):
        """The pullback's cotangent for an output cotangent dy: (dy, 1) with stage aux losses, else dy."""
        if not self.stage_aux:
            return dy
        return dy, vary(jnp.ones((), jnp.float32), tuple(vma(self.term0)))

    def probe(self, w0, x0, mb0):
        """Traces one layer's pullback to learn its treedef and which leaves are real residuals (to store),
        which are the weights or microbatch inputs (refetched in the backward), and which are constants."""
        _, probe, _, _ = self.vjp_layer(w0, x0, mb0)
        probe_leaves, self.treedef = jax.tree.flatten(probe)
        w_leaves, mb_leaves = jax.tree.leaves(w0), jax.tree.leaves(mb0)
        roles = []  # per pullback leaf: ("w", i) | ("mb", i) | ("const", leaf) | ("res", i)
        for leaf in probe_leaves:
            if any(leaf is a for a in w_leaves):
                roles.append(("w", next(i for i, a in enumerate(w_leaves) if leaf is a)))
            elif any(leaf is a for a in mb_leaves):
                roles.append(("mb", next(i for i, a in enumerate(mb_leaves) if leaf is a)))
            elif "pipe" not in vma(leaf):  # derived from neither the weights nor the inputs
                roles.append(("const", leaf))
            else:
                roles.append(("res", sum(r == "res" for r, _ in roles)))
        self.roles = roles
        self.res_avals = [leaf for (r, _), leaf in zip(roles, probe_leaves) if r == "res"]
        if self.split_w:
            self.split = SplitBackward(lambda leaves, dy: jax.tree.unflatten(self.treedef, leaves)(self.seed(dy)),
                                       probe_leaves, x0)
            self.boundary0 = self.split.b(probe_leaves, x0)[1]  # only their types are used

    def slot_avals(self):
        """What one activation slot holds: the chunk input (remat) or every layer's residuals."""
        if self.remat:
            return [self.x0]
        return self.stack_like(self.res_avals)

    def cot_avals(self):
        """What one boundary slot holds (`split_w`): each of a chunk's layers' boundary values (B -> W)."""
        return self.stack_like(self.boundary0)

    def forward(self, w, x, mb, active=None):
        """The chunk of weights `w` on x -> (y, what to store in the slot, aux loss term or None, stats or ()).
        `active`: the chunk's layer slots that hold a layer (an uneven layout), or None: all."""
        if self.forward_only or self.remat:
            def body(h, wl):
                y, term, stats = self.apply(wl, h, mb)
                return y, (term, stats)
            y, (terms, stats) = self.over_layers(body, x, w, active=active)
            if self.forward_only:  # evaluation: the loss alone
                return y, (), None, ()
            return y, (x,), self.total(terms), stats
        return self.forward_residuals(w, x, mb, active)

    def total(self, terms):
        return None if terms is None else jnp.sum(terms) if self.layered else terms

    def layer_residuals(self, wl, h, mb):
        """One layer's forward with its vjp -> (y, (its residual leaves, aux term, stats))."""
        y, pb, term, stats = self.vjp_layer(wl, h, mb)
        leaves, refs = jax.tree.leaves(pb), {"w": jax.tree.leaves(wl), "mb": jax.tree.leaves(mb)}
        if len(leaves) != len(self.roles) or any(r in refs and a is not refs[r][i]
                                                 for (r, i), a in zip(self.roles, leaves)):
            raise RuntimeError("the stage's pullback changed structure between traces; stage_fn / layer_fn "
                               "must not branch in Python on the values of its inputs")
        return y, (tuple(a for (r, _), a in zip(self.roles, leaves) if r == "res"), term, stats)

    def forward_residuals(self, w, x, mb, active=None):
        """The chunk's forward with a vjp per layer -> (y, residual leaves stacked over layers, term, stats)."""
        def body(h, wl):
            return self.layer_residuals(wl, h, mb)
        y, (res, terms, stats) = self.over_layers(body, x, w, active=active)
        return y, res, self.total(terms), stats

    def can_overlap(self) -> bool:
        """Whether `forward_backward` applies: a chunk of layers (`layer_fn`) whose forward stores residuals."""
        return self.layered and not self.remat and not self.forward_only

    def forward_backward(self, wf, x, mbf, wb, slot, mbb, slots, dy):
        """The forward of one chunk (weights wf, input x, microbatch mbf) and the fused backward of another
        (wb, its residuals in `slots[slot]`, microbatch mbb, output cotangent dy) in **one** scan over the
        layers: step i runs forward layer i and backward layer L-1-i. The two share no data, so within one
        loop body the compiler may run one's collectives (a MoE layer's all-to-alls) while the other
        computes (DualPipe's overlapped F & B). The forward's ops are named `pair_forward`, the backward's
        `pair_backward` (`jax.named_scope`: the compiled program's op names tell them apart). Chunks of equal
        layer counts (an even layout). -> ((y, residuals, term, stats) as `forward`, (dx, dW) as `backward`)."""
        res_b = tuple(s[slot] for s in slots)
        n = self.num_layers
        dw0 = jax.tree.map(lambda a: zeros(jax.ShapeDtypeStruct(a.shape, a.dtype), axes=vma(a)), wb)

        def body(carry, i):
            h, d, dw = carry
            with jax.named_scope("pair_forward"):
                y, out = self.layer_residuals(self.layer(wf, i), h, mbf)
            with jax.named_scope("pair_backward"):
                j = n - 1 - i
                dwl, dx = self.pullback(self.layer(wb, j), tuple(r[j] for r in res_b), mbb)(self.seed(d))
                dw = jax.tree.map(lambda a, g: jax.lax.dynamic_update_index_in_dim(a, vary(g, tuple(vma(a))), j, 0),
                                  dw, dwl)
            return (y, dx, dw), out
        (y, dx, dw), (res, terms, stats) = jax.lax.scan(body, (x, dy, dw0), jnp.arange(n))
        return (y, res, self.total(terms), stats), (dx, dw)

    def pullback_leaves(self, wl, res, mb):
        """One layer's pullback leaves from its weights wl and residual leaves res."""
        w_leaves, mb_leaves = jax.tree.leaves(wl), jax.tree.leaves(mb)
        return [w_leaves[i] if r == "w" else mb_leaves[i] if r == "mb" else i if r == "const" else
                res[i] for r, i in self.roles]

    def pullback(self, wl, res, mb):
        """One layer's pullback rebuilt from its weights wl and residual leaves res."""
        return jax.tree.unflatten(self.treedef, self.pullback_leaves(wl, res, mb))

    def backward(self, w, slot, mb, slots, dy, cots, need_dx, need_dw, active=None):
        """The chunk of weights `w` -> (dx or None, dW of the chunk or None, per-layer output cotangents to
        store or None).

        B / BW run down the layers, each layer's pullback taking the cotangent of its output; B keeps only
        dx (the weight-gradient products are dead code, removed by the compiler) and, with `split_w`,
        stores each layer's output cotangent. W then runs each layer's pullback once more on that
        cotangent and keeps only dW: the weight-gradient products alone, no chain through the chunk, so
        B + W does the work of one BW. Without per-layer cotangents (an opaque chunk, or remat) W takes
        the chunk's output cotangent and re-runs the chain below it (the inner layers' dx, then dead)."""
        if self.remat:  # recompute the residuals from the stored chunk input
            res = self.forward_residuals(w, slots[0][slot], mb, active)[1]
        else:
            res = tuple(s[slot] for s in slots)
        if cots is not None:  # W: each layer's weight-gradient equations on B's stored boundary values
            def body(c, xs):
                wl, rl, bnd = xs
                return c, self.split.w(self.pullback_leaves(wl, rl, mb), bnd)
            return None, self.over_layers(body, None, (w, res, cots), active=active)[1], None

        if self.split_w and need_dx and not need_dw:  # B: the input-cotangent equations, keeping the boundary
            def body(d, xs):
                wl, rl = xs
                return self.split.b(self.pullback_leaves(wl, rl, mb), d)
            dx, stored = self.over_layers(body, dy, (w, res), reverse=True, active=active)
            return dx, None, stored

        def body(d, xs):
            wl, rl = xs
            dwl, dx = self.pullback(wl, rl, mb)(self.seed(d))
            return dx, dwl if need_dw else None
        dx, dw = self.over_layers(body, dy, (w, res), reverse=True, active=active)
        return (dx if need_dx else None), dw, None
