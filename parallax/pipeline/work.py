"""The work of a pipelined step, counted per switch branch of the traced executor.

`branch_flops` reads the jaxpr of a step that calls `pipeline_value_and_grad`, finds the tick loop's
`lax.switch`, removes dead code from each branch (what the compiler removes too: B's weight-gradient
products, W's input cotangent) and counts each branch's matmul FLOPs (`dot_general`, 2 per multiply-add,
scans multiplied by their length). `step_flops` weighs them by how often the schedule runs each branch.
This is what a split backward costs, measured instead of assumed: for zb_h1 / zbv to do 1F1B's work,
B + W must cost one fused BW.
"""
import numpy as np

from parallax.compat import dce_jaxpr
from parallax.pipeline.program import Field, Op

BRANCH_NAMES = {Op.IDLE: "idle", Op.F: "F", Op.F_FIRST: "F_first", Op.F_LAST: "F_last", Op.B: "B",
                Op.B_FIRST: "B_first", Op.W: "W", Op.BW: "BW", Op.BW_FIRST: "BW_first"}


def dot_flops(jaxpr) -> int:
    """Matmul FLOPs of a (dead-code-free) jaxpr: 2 * M * N * K per dot_general, nested jaxprs included
    (a scan's body times its length)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            contract = int(np.prod([lhs[i] for i in lc]))
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * contract
            continue
        inner = [_open(p) for p in eqn.params.values() if _open(p) is not None]
        inner += [_open(b) for p in eqn.params.values() if isinstance(p, (tuple, list)) for b in p
                  if _open(b) is not None]
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        if eqn.primitive.name == "cond":  # a switch inside a branch: its most expensive case
            total += max(dot_flops(j) for j in inner)
        else:
            total += times * sum(dot_flops(j) for j in inner)
    return total


def _open(p):
    """The Jaxpr inside a param (a Jaxpr or ClosedJaxpr), else None."""
    if hasattr(p, "jaxpr") and hasattr(p, "consts"):
        return p.jaxpr
    if hasattr(p, "eqns"):
        return p
    return None


def _tick_switch(jaxpr):
    """The `cond` eqn (lax.switch) inside the tick scan inside the shard_map of a traced step."""
    for eqn in jaxpr.eqns:
        for p in list(eqn.params.values()):
            j = _open(p)
            if j is None:
                continue
            if eqn.primitive.name == "scan":
                found = [e for e in j.eqns if e.primitive.name == "cond" and len(e.params["branches"]) > 1]
                if found:
                    return found[0]
            found = _tick_switch(j)
            if found is not None:
                return found
    return None


def branch_flops(closed_jaxpr) -> list:
    """FLOPs of each branch of the tick switch in a traced step (`jax.make_jaxpr(step)(...)`), after dead
    code elimination, in the order of `Program.branches`."""
    switch = _tick_switch(closed_jaxpr.jaxpr)
    if switch is None:
        raise ValueError("no pipeline tick switch in this jaxpr: trace a step that calls pipeline_value_and_grad")
    out = []
    for branch in switch.params["branches"]:
        live, _ = dce_jaxpr(branch.jaxpr, [True] * len(branch.jaxpr.outvars))
        out.append(dot_flops(live))
    return out


def step_flops(closed_jaxpr, prog) -> dict:
    """{branch name: FLOPs of one run of it, ..., "total": FLOPs of the whole schedule on all ranks} for a
    traced step running `prog` (`compile_schedule(schedule)`)."""
    per_branch = branch_flops(closed_jaxpr)  # a steady program's switch: its branches once per weight version
    n = len(prog.branches)
    if prog.pair_code is not None:  # the switch's branches are the pairs of branches (`F+BW`)
        index, pairs = prog.pair_branches()
        counts = np.bincount(index.ravel(), minlength=len(pairs))
        names = {"+".join(BRANCH_NAMES[prog.branches[k]] for k in pair): f for pair, f in zip(pairs, per_branch)}
        return {**names, "total": int(sum(int(c) * f for c, f in zip(counts, per_branch)))}
    index = prog.code[..., Field.BRANCH] + n * prog.code[..., Field.VERSION]
    counts = np.bincount(index.ravel(), minlength=n * prog.num_versions)
    names = {BRANCH_NAMES[b]: f for b, f in zip(prog.branches, per_branch)}
    return {**names, "total": int(sum(int(c) * f for c, f in zip(counts, per_branch)))}


def messages_moved(prog) -> dict:
    """Activation / cotangent messages moved between pipeline ranks in one step of `prog`, in units of one
    message (times its bytes: rows x seq / seq shards x d_model x dtype bytes, per device):
    - "every_tick": both ring permutes over all their pairs on every tick (the executor before send patterns);
    - "sent": what the executor moves: one permute per send pattern, on its ticks (`Program.send_patterns`);
    - "needed": the messages the schedule consumes on another rank (the minimum)."""
    sent, needed = 0, 0
    lanes = (prog.code,) if prog.pair_code is None else (prog.code, prog.pair_code)
    for lane, code in enumerate(lanes):  # a paired program's lanes move their messages apart
        for direction in ("up", "down"):
            index, patterns = prog.send_patterns(direction, lane)
            sent += sum(len(patterns[i - 1]) for i in index.tolist() if i)
        up, down = code[..., Field.FROM_UP], code[..., Field.FROM_DOWN]  # the receiver's inbox entry, or -1
        needed += int((up >= 0).sum() + (down >= 0).sum())
    return {"every_tick": prog.num_ticks * (len(prog.up_perm) + len(prog.down_perm)) * len(lanes), "sent": sent,
            "needed": needed}
