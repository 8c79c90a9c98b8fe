"""A layer's backward split into B (what the input cotangent needs) and W (the weight gradients alone).

Zero-bubble schedules run a stage's backward in two actions: B, which the previous stage waits for, and W,
which fills the bubbles. Calling the pullback twice and keeping half of each (what the executor does for a
black-box chunk) makes W redo most of B: a weight's gradient needs the cotangent at the weight's output,
and that cotangent comes down the same chain of products as the input cotangent. Splitting per layer does
not help either: a norm gain before the attention needs the cotangent that flows through every
projection of the layer.

So the split is made on the pullback's own program. `SplitBackward` traces one layer's pullback
`(residuals, dy) -> (dw, dx)` to a jaxpr once (calls such as `jit` and `checkpoint` inlined, so every
primitive is visible) and partitions its equations:
- B = every equation the input cotangent dx depends on;
- W = every other equation the weight gradients depend on (in a transformer layer: each projection's
  `x^T @ dy` product, the norm gains' reductions);
- the boundary = the values W reads that B computes (the cotangents at the weights' outputs).
B runs its equations and returns dx and the boundary; the executor stores the boundary in the
microbatch's slot until W runs W's equations on it. Every equation of the fused backward runs exactly once
(B + W = BW, counted in `parallax.pipeline.work`), at the cost of holding the boundary between B and W,
as the zero-bubble paper's W does.
"""
import jax

from parallax.compat import DropVar, Literal, Var

# Call-like primitives whose body is inlined, so that their equations can go to B or to W separately.
_INLINE = {"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "remat"}


def _eval(eqns, env):
    """Evaluates `eqns` in order, reading and writing `env` (Var -> value); call-like eqns are inlined."""
    def read(v):
        return v.val if isinstance(v, Literal) else env[v]
    for eqn in eqns:
        invals = [read(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINE else None
        if inner is not None:
            jaxpr, consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
            sub = dict(zip(jaxpr.constvars, consts))
            sub.update(zip(jaxpr.invars, invals))
            _eval(jaxpr.eqns, sub)
            outs = [v.val if isinstance(v, Literal) else sub[v] for v in jaxpr.outvars]
        else:
            bind = eqn.primitive.get_bind_params(eqn.params)  # jax 0.10: params; older: (subfuns, params)
            subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *invals, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, DropVar):
                env[v] = x


def _live(eqns, outvars):
    """The equations `outvars` depend on, in order."""
    need = {v for v in outvars if isinstance(v, Var)}
    keep = []
    for eqn in reversed(eqns):
        if any(v in need for v in eqn.outvars):
            keep.append(eqn)
            need.update(v for v in eqn.invars if isinstance(v, Var))
    return keep[::-1]


class SplitBackward:
    """One layer's pullback, traced once and split into B and W (module docstring).

    pullback_fn(leaves, dy) -> (dw, dx): the layer's pullback rebuilt from its pullback leaves; `leaves`
    and `dy` are examples (tracers of the probe) giving the types.
    """

    def __init__(self, pullback_fn, leaves, dy):
        flat_in, self.in_tree = jax.tree.flatten((leaves, dy))
        # Trace once, then re-trace through `_eval` so that the jaxpr has call-like bodies inlined.
        closed = jax.make_jaxpr(lambda *a: pullback_fn(*jax.tree.unflatten(self.in_tree, a)))(*flat_in)

        def flat_fn(*a):
            env = dict(zip(closed.jaxpr.constvars, closed.consts))
            env.update(zip(closed.jaxpr.invars, a))
            _eval(closed.jaxpr.eqns, env)
            return [v.val if isinstance(v, Literal) else env[v] for v in closed.jaxpr.outvars]
        flat = jax.make_jaxpr(flat_fn)(*flat_in)
        self.jaxpr, self.consts = flat.jaxpr, flat.consts
        _, self.out_tree = jax.tree.flatten(jax.eval_shape(lambda *a: pullback_fn(*jax.tree.unflatten(self.in_tree, a)),
                                                           *flat_in))
        outvars = self.jaxpr.outvars
        self.num_dw = len(outvars) - 1  # outputs: dw leaves..., dx (one array)
        self.b_eqns = _live(self.jaxpr.eqns, outvars[-1:])
        in_b = {id(e) for e in self.b_eqns}
        self.w_eqns = [e for e in _live(self.jaxpr.eqns, outvars[:-1]) if id(e) not in in_b]
        b_defined = {v for e in self.b_eqns for v in e.outvars} | set(self.jaxpr.invars[-1:])
        w_reads = [v for e in self.w_eqns for v in e.invars] + list(outvars[:-1])
        self.boundary = list(dict.fromkeys(v for v in w_reads if isinstance(v, Var) and v in b_defined))

    def _env(self, leaves, dy):
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, jax.tree.leaves((leaves, dy))))
        return env

    def b(self, leaves, dy):
        """-> (dx, boundary values for W)."""
        env = self._env(leaves, dy)
        _eval(self.b_eqns, env)
        out = self.jaxpr.outvars[-1]
        dx = out.val if isinstance(out, Literal) else env[out]
        return dx, tuple(env[v] for v in self.boundary)

    def w(self, leaves, boundary):
        """-> dw (the pullback's first output) from the layer's pullback leaves and B's boundary values."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update((v, a) for v, a in zip(self.jaxpr.invars[:-1], jax.tree.leaves(leaves)))
        env.update(zip(self.boundary, boundary))
        _eval(self.w_eqns, env)
        dw = [v.val if isinstance(v, Literal) else env[v] for v in self.jaxpr.outvars[:-1]]
        return jax.tree.unflatten(self.dw_tree, dw)

    @property
    def dw_tree(self):
        return jax.tree.structure(jax.tree.unflatten(self.out_tree, [0] * (self.num_dw + 1))[0])
