"""What one compiled step costs a device, counted from its optimized HLO with every loop's trip count.

`compiled.cost_analysis()` is XLA's own count, but it visits a `while` body once, and parallax scans its layers
(and the pipeline executor loops over ticks), so it undercounts a step by about the number of layers. This
walks the program instead: each computation's own cost, plus each computation it calls times how often:
a `while` body `known_trip_count` times (XLA's annotation of a counted loop; a loop without one counts once and
is reported in `unknown_loops`), a fusion's or call's computation once per call. Of a `conditional` (the
pipeline executor's switch over a tick's actions) it counts the costliest branch, an upper bound for one
execution; `branches` lists them all for a caller that knows how often each runs.

Counted per device (SPMD programs are per device):
- `flops`: the matmuls' (`dot`: 2 x output elements x contracted size; `convolution`, what TPU makes of a dot:
  2 x output elements x kernel elements per output feature), the figure MFU is quoted in. Elementwise work is
  not counted; custom calls (Pallas kernels, cuBLAS) are counted in `custom_calls`, not in FLOPs.
- `bytes`: what the program's top-level instructions (fusions, dots, copies, collectives; not a fusion's
  inside, which stays in registers / VMEM) read and write: each operand and result once, a dynamic slice or
  update of a buffer as the slice, not the buffer (a scanned layer reads its own weights, not the stack).
  The memory-traffic estimate: the compiler may keep small operands on chip, so it is an upper bound.
- `collectives`: per (kind, mesh axes) the count, the bytes of their results and the bytes one device sends
  on a ring (`parallax.hlo.collective_traffic`'s rule); the axes are read from the device groups with the
  mesh's shape (device ids are positions in the mesh's device order). Given each device's slice
  (`step_costs(slices=...)`), `dcn_count` / `dcn_sent` count those whose groups span slices. The TPU
  compiler's multi-slice program is one slice's: its collectives run inside the slice (device ids are the
  slice's own), and what crosses slices is a host transfer to the Megascale runtime (a `send` with
  `_xla_megascale_transfer_type`, e.g. ALL_REDUCE), counted here as that collective over the mesh axes that
  span slices (`dcn`), a ring over the slices.
- `windows`: every collective once per execution, with what the compiled schedule runs while it is in
  flight: for an async pair (`all-gather-start` ... `all-gather-done`, or `async-start` / `async-done`
  around one) the FLOPs and bytes of the instructions between its start and its done (loops among them
  with their trip counts); a synchronous collective has an empty window. The step-time estimate
  (`parallax.estimate`) hides a collective behind its window's compute, and no more. Two collectives in
  flight at once are each credited with the whole window (their links are separate when their axes are).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

from parallax import hlo

_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"(?P<op>[a-z][a-z0-9_-]*)\(")
_OPERAND = re.compile(r"%([^\s,()]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"\}')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)")
_PARAM_INDEX = re.compile(r"parameter\(([0-9]+)\)")
_COND = re.compile(r"condition=%([^\s,)}]+)")
_DIRECTION = re.compile(r"direction=([A-Z]+)")
_INDEX = re.compile(r"\sindex=([0-9]+)")
_CONSTANT = re.compile(r"\sconstant\((-?[0-9]+)\)")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


def _constant(ins) -> int | None:
    """The value of an integer scalar `constant` instruction (None for anything else)."""
    match = _CONSTANT.search(ins.line)
    return int(match[1]) if match and ins.arrays and ins.arrays[0][1] == () else None

# Instructions that move no data of their own: views, tuples, control flow (its computations are counted).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota",
         "async-done", "all-gather-done", "all-reduce-done", "collective-permute-done", "copy-done",
         "send-done", "recv-done"}
_SLICES = {"dynamic-slice", "slice"}


@dataclasses.dataclass
class _Instruction:
    name: str
    op: str
    arrays: list  # [(dtype, shape)] of its result (a tuple: each element)
    operands: list  # operand names
    line: str

    @property
    def nbytes(self) -> int:
        return sum(_size(a) for a in self.arrays)


def _size(array) -> int:
    dtype, shape = array
    return math.prod(shape) * hlo._BYTES.get(dtype, 4)


def _split(text: str, open_: str, close: str) -> int:
    """The index just past the bracket closing the one `text` starts with."""
    depth = 0
    for i, c in enumerate(text):
        depth += c == open_
        depth -= c == close
        if depth == 0:
            return i + 1
    return len(text)


def _parse(line: str) -> _Instruction | None:
    head = _HEAD.match(line)
    if head is None:
        return None
    rest = line[head.end():]
    end = _split(rest, "(", ")") if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode = _OPCODE.match(rest)
    if opcode is None:
        return None
    args_end = opcode.end() - 1 + _split(rest[opcode.end() - 1:], "(", ")")
    arrays = [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in hlo._TYPED_ARRAY.findall(shape)]
    return _Instruction(head["name"], opcode["op"], arrays, _OPERAND.findall(rest[opcode.end():args_end - 1]),
                        line)


@dataclasses.dataclass
class StepCosts:
    flops: float = 0.0
    bytes: float = 0.0
    collectives: dict = dataclasses.field(default_factory=dict)  # (op, axes) -> {count, bytes, sent}
    custom_calls: int = 0
    unknown_loops: int = 0
    branches: list = dataclasses.field(default_factory=list)  # per conditional: each branch's StepCosts
    # per collective instruction: {op, axes, sent, dcn_sent, times (executions), flops, bytes (its window)}
    windows: list = dataclasses.field(default_factory=list)

    def add(self, other: StepCosts, times: float = 1) -> None:
        self.flops += times * other.flops
        self.bytes += times * other.bytes
        self.custom_calls += times * other.custom_calls
        self.unknown_loops += other.unknown_loops
        for key, c in other.collectives.items():
            mine = self.collectives.setdefault(key, _record())
            for k in mine:
                mine[k] += times * c[k]
        self.branches += other.branches
        self.windows += [dict(w, times=w["times"] * times) for w in other.windows]

    def dcn_sent(self) -> float:
        """Bytes one device sends in collectives whose groups span slices."""
        return sum(c.get("dcn_sent", 0.0) for c in self.collectives.values())

    def by_kind(self, field: str = "sent") -> dict[str, float]:
        """{collective kind: bytes} (`sent`: what one device sends; `bytes`: the results' size)."""
        out: dict[str, float] = {}
        for (op, _), c in self.collectives.items():
            out[op] = out.get(op, 0.0) + c[field]
        return out

    def by_axes(self, field: str = "sent") -> dict[tuple[str, ...], float]:
        """{mesh axes a collective runs over: bytes}."""
        out: dict[tuple[str, ...], float] = {}
        for (_, axes), c in self.collectives.items():
            out[axes] = out.get(axes, 0.0) + c[field]
        return out


def _record() -> dict:
    return {"count": 0, "bytes": 0.0, "sent": 0.0, "dcn_count": 0, "dcn_sent": 0.0}


def _axes(groups, mesh_shape: dict[str, int] | None) -> tuple[str, ...]:
    """The mesh axes along which the devices of `groups` differ (`mesh_shape`: {axis: size} in mesh order)."""
    if not mesh_shape:  # no mesh: named by the group size
        size = max(len(g) for g in groups)
        return (f"groups of {size}",) if size > 1 else ()
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # [devices, axes]
        varying |= {names[k] for k in range(len(names)) if len(set(coords[:, k])) > 1}
    return tuple(n for n in names if n in varying)


def _window(line: str, spatial: int) -> list[dict]:
    """Per spatial dimension of a convolution: size, stride, padding, dilations (HLO's `window={...}`)."""
    dims = [dict(size=1, stride=1, lo=0, hi=0, lhs_dilate=1, rhs_dilate=1) for _ in range(spatial)]
    match = re.search(r"window=\{([^}]*)\}", line)
    for field in (match[1].split() if match else []):
        key, _, value = field.partition("=")
        for d, part in enumerate(value.split("x")[:spatial]):
            if key == "pad":
                lo, hi = part.split("_")
                dims[d].update(lo=int(lo), hi=int(hi))
            elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
                dims[d][key] = int(part)
    return dims


def _conv_flops(line, labels, lhs, rhs, out) -> float:
    """2 x output batch x output features x input features (per group) x, per spatial dimension, the
    (output position, window tap) pairs that land on a real input element: the TPU compiler writes dots as
    convolutions whose padded windows mostly hit padding (an output dimension of the kernel becomes a window
    sliding over a size-1 input), so counting every tap would overcount them by the window's size."""
    lhs_l, rhs_l, out_l = labels
    spatial = sum(c.isdigit() for c in out_l)
    pairs = 1
    for d, w in enumerate(_window(line, spatial)):
        n, m = lhs[lhs_l.index(str(d))], out[out_l.index(str(d))]
        span, o = (n - 1) * w["lhs_dilate"], np.arange(m) * w["stride"] - w["lo"]
        valid = 0
        for t in range(w["size"]):  # the input positions tap t reads, for every output position at once
            x = o + t * w["rhs_dilate"]
            valid += int(np.count_nonzero((x >= 0) & (x <= span) & (x % w["lhs_dilate"] == 0)))
        pairs *= valid
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs


class _Program:
    def __init__(self, text: str, mesh_shape: dict[str, int] | None, num_devices: int, slices=None,
                 dcn: dict[str, int] | None = None):
        self.mesh_shape, self.num_devices, self.slices = mesh_shape, num_devices, slices
        self.num_slices = math.prod((dcn or {}).values()) if dcn else 1
        self.dcn_axes = tuple(a for a, d in (dcn or {}).items() if d > 1)
        if self.num_slices > 1 and "xla_megascale_runtime" in text and mesh_shape:  # one slice's program
            self.mesh_shape = {a: n // dcn.get(a, 1) for a, n in mesh_shape.items()}
            self.num_devices, self.slices = math.prod(self.mesh_shape.values()), None
        self.comps = {name: [i for i in map(_parse, lines) if i is not None]
                      for name, lines in hlo._computations(text).items()}
        self.entry = next(m["name"] for line in text.splitlines()
                          for m in [hlo._COMPUTATION.match(line)] if m and line.startswith("ENTRY"))
        self.memo: dict[str, StepCosts] = {}

    def costs(self, name: str) -> StepCosts:
        if name not in self.memo:
            self.memo[name] = self._costs(name)
        return self.memo[name]

    def _costs(self, name: str) -> StepCosts:
        out = StepCosts()
        symbols = {i.name: i for i in self.comps.get(name, [])}
        in_flight: dict[str, list[dict]] = {}  # an async start's name -> the windows it opened
        for ins in self.comps.get(name, []):
            flops, bytes_, opened = out.flops, out.bytes, len(out.windows)
            self._instruction(ins, symbols, out)
            if ins.op.endswith("-done") and ins.operands and ins.operands[0] in in_flight:
                del in_flight[ins.operands[0]]
            elif (ins.op.endswith("-start") or ins.op == "send") and len(out.windows) > opened:
                in_flight[ins.name] = out.windows[opened:]
            else:
                for window in (w for ws in in_flight.values() for w in ws):
                    window["flops"] += out.flops - flops
                    window["bytes"] += out.bytes - bytes_
        return out

    def _instruction(self, ins: _Instruction, symbols, out: StepCosts) -> None:
        out.flops += self._flops(ins, symbols)
        out.custom_calls += ins.op == "custom-call"
        self._collective(ins, out)
        if ins.op == "while":
            trip = self._trip_count(ins, symbols)
            out.unknown_loops += trip is None
            for callee in hlo._called(ins.line):
                out.add(self.costs(callee), 1 if trip is None else trip)
        elif ins.op == "conditional":
            branches = [self.costs(c) for c in hlo._called(ins.line)]
            if branches:
                out.add(max(branches, key=lambda b: (b.flops, b.bytes)))
                out.branches.append(branches)
        elif ins.op == "fusion":
            for callee in hlo._called(ins.line):  # its matmuls and custom calls; its bytes are the fusion's
                inner = self.costs(callee)
                out.flops += inner.flops
                out.custom_calls += inner.custom_calls
            out.bytes += self._fusion_bytes(ins, symbols)
        else:
            for callee in hlo._called(ins.line):  # call, async wrappers; not reductions' to_apply
                if ins.op in ("call", "async-start") or ins.op.endswith("-start") and "calls=" in ins.line:
                    out.add(self.costs(callee))
        if ins.op not in _FREE and ins.op != "fusion":
            out.bytes += self._bytes(ins, symbols)

    def _trip_count(self, ins: _Instruction, symbols) -> int | None:
        """XLA's `known_trip_count` (XLA:CPU / GPU annotate counted loops), else read off the loop (the TPU
        compiler prints no annotation): a condition `counter < N` (or <=) on a tuple element whose initial value
        in the while's operand is a constant; the counter steps by 1 (a scan's, a fori_loop's)."""
        known = _TRIP.search(ins.line)
        if known:
            return int(known[1])
        cond = _COND.search(ins.line)
        lines = self.comps.get(cond[1], []) if cond else []
        inner = {i.name: i for i in lines}
        root = lines[-1] if lines else None
        direction = _DIRECTION.search(root.line) if root is not None and root.op == "compare" else None
        if direction is None or direction[1] not in ("LT", "LE") or len(root.operands) != 2:
            return None
        counter, bound = (inner.get(o) for o in root.operands)
        if counter is None or bound is None or counter.op != "get-tuple-element" or bound.op != "constant":
            return None
        index = _INDEX.search(counter.line)
        init = symbols.get(ins.operands[0]) if ins.operands else None
        start = None
        if index and init is not None and init.op == "tuple" and int(index[1]) < len(init.operands):
            start = symbols.get(init.operands[int(index[1])])
            while start is not None and start.op in ("copy", "bitcast") and start.operands:  # TPU copies it
                start = symbols.get(start.operands[0])
        start_value = _constant(start) if start is not None and start.op == "constant" else None
        end = _constant(bound)
        if start_value is None or end is None:
            return None
        return max(0, end - start_value + (direction[1] == "LE"))

    @staticmethod
    def _flops(ins: _Instruction, symbols) -> float:
        if ins.op == "dot":
            lhs = symbols.get(ins.operands[0]) if ins.operands else None
            dims = _CONTRACT.search(ins.line)
            if lhs is None or dims is None:
                return 0.0
            shape = lhs.arrays[0][1]
            return 2.0 * math.prod(ins.arrays[0][1]) * math.prod(shape[int(d)] for d in dims[1].split(",") if d)
        if ins.op == "convolution":
            lhs, rhs = (symbols.get(o) for o in (ins.operands + [None, None])[:2])
            labels = _DIM_LABELS.search(ins.line)
            if lhs is None or rhs is None or labels is None:
                return 0.0
            return _conv_flops(ins.line, labels.groups(), lhs.arrays[0][1], rhs.arrays[0][1], ins.arrays[0][1])
        return 0.0

    @staticmethod
    def _operand_bytes(ins: _Instruction, symbols) -> int:
        return sum(symbols[o].nbytes for o in ins.operands if o in symbols)

    def _bytes(self, ins: _Instruction, symbols) -> float:
        if ins.op in _SLICES:  # reads the slice
            return 2 * ins.nbytes
        if ins.op == "dynamic-update-slice":  # in place: reads and writes the update
            update = symbols.get(ins.operands[1]) if len(ins.operands) > 1 else None
            return 2 * (update.nbytes if update else ins.nbytes)
        start = ins.op.endswith("-start")
        result = ins.arrays[-1:] if start and ins.arrays else ins.arrays
        return self._operand_bytes(ins, symbols) + sum(_size(a) for a in result)

    def _fusion_bytes(self, ins: _Instruction, symbols) -> float:
        """A fusion reads each operand once, but of a parameter its fused computation only slices (or updates
        in place) just the slice; it writes its result, or of an in-place update just the update."""
        callee = next(iter(hlo._called(ins.line)), None)
        inner = self.comps.get(callee, [])
        params = {i.name: int(_PARAM_INDEX.search(i.line)[1]) for i in inner if i.op == "parameter"}
        uses: dict[str, list[_Instruction]] = {}
        for i in inner:
            for k, o in enumerate(i.operands):
                uses.setdefault(o, []).append((i, k))
        inner_symbols = {i.name: i for i in inner}
        read = 0.0
        for pname, index in params.items():
            if index >= len(ins.operands) or ins.operands[index] not in symbols:
                continue
            full = symbols[ins.operands[index]].nbytes
            users = uses.get(pname, [])
            if users and all(k == 0 and u.op in (*_SLICES, "dynamic-update-slice") for u, k in users):
                read += sum(u.nbytes if u.op in _SLICES else 0 for u, k in users)
            else:
                read += full
        root = inner[-1] if inner else None
        while root is not None and root.op == "bitcast" and root.operands and root.operands[0] in inner_symbols:
            root = inner_symbols[root.operands[0]]
        if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
            update = inner_symbols.get(root.operands[1])
            written = update.nbytes if update else ins.nbytes
        else:
            written = ins.nbytes
        return read + written

    def _collective(self, ins: _Instruction, out: StepCosts) -> None:
        match = hlo._INSTRUCTION.search(ins.line.split("\n")[0])
        if match is None:
            megascale = _MEGASCALE.search(ins.line) if ins.op == "send" else None
            if megascale:
                op = megascale[1].lower().replace("_", "-")
                size = _size(ins.arrays[0]) if ins.arrays else 0
                self._record(out, op, self.dcn_axes, size, hlo.ring_sent(op, max(self.num_slices, 2), size), True)
            return
        op = match["op"]
        arrays = ins.arrays[-1:] if match["start"] and ins.arrays else ins.arrays
        size = sum(_size(a) for a in arrays)
        groups = hlo._groups(ins.line, self.num_devices)
        sent = hlo.ring_sent(op, max(len(x) for x in groups), size)
        crosses = self.slices is not None and any(len({self.slices[d] for d in g}) > 1 for g in groups)
        self._record(out, op, _axes(groups, self.mesh_shape), size, sent, crosses)

    @staticmethod
    def _record(out: StepCosts, op: str, axes: tuple, size: float, sent: float, crosses: bool) -> None:
        key = (op, axes)
        mine = out.collectives.setdefault(key, _record())
        mine["count"] += 1
        mine["bytes"] += size
        mine["sent"] += sent
        mine["dcn_count"] += crosses
        mine["dcn_sent"] += sent if crosses else 0.0
        out.windows.append({"op": op, "axes": key[1], "sent": sent, "dcn_sent": sent if crosses else 0.0,
                            "times": 1, "flops": 0.0, "bytes": 0.0})


def step_costs(compiled_or_hlo_text, mesh_shape: dict[str, int] | None = None,
               num_devices: int | None = None, slices=None, dcn: dict[str, int] | None = None) -> StepCosts:
    """The per-device costs of one execution of a compiled program (see the module's docstring).
    `mesh_shape`: {axis: size} of the mesh it was compiled for, in mesh order (e.g. `dict(mesh.shape)`), to
    name the axes each collective crosses; `num_devices` defaults to its product. `slices`: the slice of
    each device id (`parallax.mesh.device_slices` of the mesh's devices in order), to count the collectives
    that cross slices; `dcn`: {axis: slices it spans} (`Plan.dcn`), to read the TPU compiler's multi-slice
    program (one slice's, with the Megascale transfers between slices)."""
    text = hlo._text(compiled_or_hlo_text)
    n = num_devices or (math.prod(mesh_shape.values()) if mesh_shape else 1)
    program = _Program(text, mesh_shape, n, None if slices is None else list(slices), dcn)
    return program.costs(program.entry)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def describe(costs: StepCosts) -> list[str]:
    """Lines for a report: FLOPs and bytes per device, then the collectives by kind and mesh axes."""
    lines = [f"per device and step (the optimized HLO counted with its loops' trip counts): {costs.flops:.4g} FLOP "
             f"in matmuls, {_bytes(costs.bytes)} read + written"
             + (f", {costs.custom_calls:g} custom calls (not in the FLOPs)" if costs.custom_calls else "")
             + (f", {costs.unknown_loops} loops of unknown trip count (counted once)" if costs.unknown_loops else "")]
    for (op, axes), c in sorted(costs.collectives.items(), key=lambda kv: -kv[1]["sent"]):
        lines.append(f"  {op} over {','.join(axes) or 'one device'}: {c['count']:g} x, {_bytes(c['bytes'])} of "
                     f"results, {_bytes(c['sent'])} sent by each device")
    return lines


def to_json(costs: StepCosts) -> str:
    return json.dumps({"flops": costs.flops, "bytes": costs.bytes, "custom_calls": costs.custom_calls,
                       "unknown_loops": costs.unknown_loops,
                       "collectives": [{"op": op, "axes": list(axes), **c}
                                       for (op, axes), c in sorted(costs.collectives.items())]})


def main(argv=None) -> None:
    """`python -m parallax.cost FILE.hlo.txt --devices=N [--chip=v5p]`: the counts of any program's optimized
    HLO text (`compiled.as_text()`, e.g. another framework's train step), its collectives named by their
    device groups' size, and the step-time estimate on `--chip`. How docs/benchmarks.md compares MaxText."""
    import argparse

    from parallax.estimate import estimate

    parser = argparse.ArgumentParser(prog="python -m parallax.cost", description=main.__doc__.split("\n")[0])
    parser.add_argument("hlo", help="a file of optimized HLO text")
    parser.add_argument("--devices", type=int, required=True, help="devices the program was compiled for")
    parser.add_argument("--chip", default="", help="estimate the step on this chip (v5p, v5e, v6e, h100, h200)")
    parser.add_argument("--kernel_flops", type=float, default=0.0, help="FLOPs per device in custom calls "
                        "(attention kernels), which the HLO does not show")
    args = parser.parse_args(argv)
    with open(args.hlo) as f:
        costs = step_costs(f.read(), None, args.devices)
    print("\n".join(describe(costs)))
    if args.chip:
        print("\n".join(estimate(costs, args.chip, kernel_flops=args.kernel_flops).lines()))


if __name__ == "__main__":
    main()
