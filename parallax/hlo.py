"""Facts about compiled programs read from their HLO text: which collectives run, and on what shapes.

Works on `jax.jit(f).lower(...).compile()` (or its `.as_text()`). Each collective counts once: the
synchronous op (`all-gather`), or the `-start` half of its async pair (`all-gather-start` /
`all-gather-done`); ops wrapped in `async-start` computations are counted in the wrapped computation.
A collective inside a loop body counts once, however many iterations run.
"""
from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# `%name = <result shape> <opcode>(<operands>) ...`; the opcode is the word right before "(".
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
_ARRAY_SHAPE = re.compile(r"[a-z][a-z0-9]*\[([0-9,]*)\]")


def _text(compiled_or_hlo_text) -> str:
    return compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()


def collective_shapes(compiled_or_hlo_text) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """Every collective as (op, result array shapes); a tuple-shaped result lists each array."""
    found = []
    for line in _text(compiled_or_hlo_text).splitlines():
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d)
                       for dims in _ARRAY_SHAPE.findall(match["shape"]))
        found.append((match["op"], shapes))
    return found


def count_collectives(compiled_or_hlo_text) -> dict[str, int]:
    """Number of each collective in the program, e.g. {'all-gather': 1, 'reduce-scatter': 1, ...}."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for op, _ in collective_shapes(compiled_or_hlo_text):
        counts[op] += 1
    return counts


_TYPED_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collective_bytes(compiled_or_hlo_text, op: str = "all-gather") -> dict[str, int]:
    """Bytes that each `op` in the program produces, summed by element type (e.g. {'s8': ..., 'f32': ...});
    of an async `-start`, its output (the last array of its tuple). Each instruction counts once, as above."""
    found: dict[str, int] = {}
    for line in _text(compiled_or_hlo_text).splitlines():
        match = _INSTRUCTION.search(line)
        if match is None or match["op"] != op:
            continue
        arrays = _TYPED_ARRAY.findall(match["shape"])
        for dtype, dims in arrays[-1:] if match["start"] else arrays:
            size = math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)
            found[dtype] = found.get(dtype, 0) + size
    return found


def largest_collective_shape(compiled_or_hlo_text) -> tuple[int, ...] | None:
    """The array shape with the most elements that any collective produces (None if there are none)."""
    shapes = [shape for _, result in collective_shapes(compiled_or_hlo_text) for shape in result]
    if not shapes:
        return None
    return max(shapes, key=math.prod)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([^\s,)}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\swhile\(.*body=%([^\s,)}]+)")


def _computations(text: str) -> dict[str, list[str]]:
    """{computation name: its instructions, one string each}. An instruction printed over several lines (a
    kernel's backend config: lines that do not start a new `%name = ...` or `ROOT`) is joined into one."""
    comps, current = {}, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = comps.setdefault(header["name"], [])
        elif line.rstrip() == "}":
            current = None
        elif current is not None:
            if current and not re.match(r"\s*(?:ROOT\s+)?%", line):
                current[-1] += "\n" + line
            else:
                current.append(line)
    return comps


def _called(line: str) -> list[str]:
    names = _CALLED.findall(line)
    for group in _BRANCHES.findall(line):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def loop_body_text(compiled_or_hlo_text) -> str:
    """The instructions of every computation a `while` loop body reaches (the layer scans, the pipeline
    executor's tick loop and its switch branches), one per line: e.g. for `collective_traffic` of the
    collectives that run per layer or per tick, without the once-per-step ones around the loops."""
    comps = _computations(_text(compiled_or_hlo_text))
    stack = [m.group(1) for lines in comps.values() for line in lines for m in [_WHILE_BODY.search(line)] if m]
    seen, lines = set(), []
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        lines += comps[name]
        stack.extend(n for line in comps[name] for n in _called(line))
    return "\n".join(lines)


def loop_body_collectives(compiled_or_hlo_text) -> list[dict[str, int]]:
    """Collective counts of each `while` loop body (with the computations it calls, e.g. `cond` branches).

    A `lax.scan` over layers compiles to one while loop for the forward and one for the backward, each
    holding one copy of the layer, so these are the per-layer counts. Bodies without collectives are left
    out; the order is that of the HLO text.
    """
    comps = _computations(_text(compiled_or_hlo_text))
    bodies = [m.group(1) for lines in comps.values() for line in lines for m in [_WHILE_BODY.search(line)] if m]
    result = []
    for body in dict.fromkeys(bodies):
        seen, stack, counts = set(), [body], dict.fromkeys(COLLECTIVES, 0)
        while stack:
            name = stack.pop()
            if name in seen or name not in comps:
                continue
            seen.add(name)
            for line in comps[name]:
                match = _INSTRUCTION.search(line)
                if match is not None:
                    counts[match["op"]] += 1
                if " while(" not in line:  # a nested loop is reported on its own
                    stack.extend(_called(line))
        if any(counts.values()):
            result.append(counts)
    return result


_GROUPS = re.compile(r"replica_groups=(\{\}|\{\{[0-9,{}]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\(\[(?P<ids>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(\{[0-9,{}]*\})\}")
_TYPED_SHAPE, _DTYPE_BYTES = _TYPED_ARRAY, _BYTES


def ring_sent(op: str, group: int, size: float) -> float:
    """Bytes one device sends for collective `op` over a ring of `group` devices, of `size` bytes (the
    result's; a permute's array): all-reduce 2 (g-1)/g, all-gather and all-to-all (g-1)/g, reduce-scatter
    (g-1) times the result, a permute the array; nothing over a group of one."""
    if group <= 1:
        return 0.0
    return {"all-reduce": 2 * (group - 1) / group * size, "all-gather": (group - 1) / group * size,
            "all-to-all": (group - 1) / group * size, "reduce-scatter": (group - 1) * size}.get(op, size)


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective line: replica groups (explicit, empty = all, iota
    `[G,S]<=[dims]T(perm)`, or over named mesh axes), or a permute's source-target pairs."""
    import numpy as np

    pairs = _PAIRS.search(line)
    if pairs:
        return [[int(d) for d in p.split(",")] for p in re.findall(r"\{([0-9,]+)\}", pairs[1])]
    mesh = _MESH_GROUPS.search(line)
    if mesh:  # replica_groups=mesh['a'=2,'b'=4] {'b'}: the devices along the named axes form each group
        axes = re.findall(r"'([^']+)'=([0-9]+)", mesh[1])
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        along = [names.index(a) for a in re.findall(r"'([^']+)'", mesh[4])]
        ids = np.arange(math.prod(sizes))
        if mesh["ids"]:  # device_ids=([dims]T(perm)): the mesh's devices in that order
            dims = [int(d) for d in mesh["ids"].split(",")]
            perm = [int(p) for p in mesh["perm"].split(",")] if mesh["perm"] else list(range(len(dims)))
            ids = ids.reshape(dims).transpose(perm).reshape(-1)
        ids = ids.reshape(sizes)
        ids = np.moveaxis(ids, along, list(range(len(sizes) - len(along), len(sizes))))
        return ids.reshape(-1, math.prod(sizes[i] for i in along)).tolist()
    match = _GROUPS.search(line)
    if match is None or match[1] == "{}":
        return [list(range(num_devices))]
    text = match[1]
    if text.startswith("{"):
        return [[int(d) for d in g.split(",")] for g in re.findall(r"\{([0-9,]+)\}", text)]
    shape, dims, perm = re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text).groups()
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids.reshape([int(d) for d in shape.split(",")]).tolist()


def collective_traffic(compiled_or_hlo_text, num_devices: int) -> list[dict]:
    """Every collective as {op, arrays: [(dtype, shape)], groups: [[device, ...], ...], sent: bytes one
    device sends}. Device ids are the program's (the positions in its mesh's device order). Bytes sent by a
    ring over a group of g: all-reduce 2 (g-1)/g of the array, all-gather and all-to-all (g-1)/g of the
    result, reduce-scatter (g-1) times the result, a permute the array. (An async `-start`'s shape lists its
    operand and result both: read synchronous programs, such as XLA:CPU's.)"""
    found = []
    for line in _text(compiled_or_hlo_text).splitlines():
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        arrays = [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _TYPED_SHAPE.findall(match["shape"])]
        groups = _groups(line, num_devices)
        g = max(len(x) for x in groups)
        size = sum(math.prod(shape) * _DTYPE_BYTES.get(t, 4) for t, shape in arrays)
        found.append({"op": match["op"], "arrays": arrays, "groups": groups, "sent": ring_sent(match["op"], g, size)})
    return found


_ASYNC_START = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=.*?\s(?:async-start|(?P<op>[a-z-]+)-start)\(")
_ASYNC_DONE = re.compile(r"\s(?:async-done|[a-z-]+-done)\(%(?P<start>[^\s,)]+)")
_COMPUTE = re.compile(r"=\s*.*?\s(?:fusion|convolution|dot|custom-call)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def collective_windows(compiled_or_hlo_text, op: str = "all-to-all", lanes=("pair_forward", "pair_backward")):
    """The async `op` collectives of a scheduled program (each start / done pair, e.g. TPU's `async-start`
    named `%all-to-all-start`), with what runs between their start and their done: one dict per collective,
    {"computation", "lane": the index in `lanes` of the named scope (`jax.named_scope`) its op name carries,
    or None, "compute": compute instructions (fusions, convolutions, dots, custom calls) in the window,
    "other": those whose op name carries another of `lanes`}. `collective_windows(...)` of the executor's
    paired ticks (`Stage.forward_backward`) counts the all-to-alls of one microbatch that overlap the other
    microbatch's compute. A synchronous collective has no window and is not listed."""
    def lane_of(line):
        name = _OP_NAME.search(line)
        return next((k for k, scope in enumerate(lanes) if name and f"/{scope}/" in name.group(1) + "/"), None)
    found = []
    for comp, lines in _computations(_text(compiled_or_hlo_text)).items():
        open_ = {}  # start name -> record
        for line in lines:
            done = _ASYNC_DONE.search(line)
            if done and done["start"] in open_:
                found.append(open_.pop(done["start"]))
                continue
            start = _ASYNC_START.match(line.split("\n")[0])
            if start and (start["op"] == op or (start["op"] is None and start["name"].startswith(op + "-start"))):
                open_[start["name"]] = {"computation": comp, "lane": lane_of(line), "compute": 0, "other": 0}
                continue
            if _COMPUTE.search(line):
                lane = lane_of(line)
                for record in open_.values():
                    record["compute"] += 1
                    record["other"] += lane is not None and record["lane"] is not None and lane != record["lane"]
    return found
