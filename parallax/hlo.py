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
    """{computation name: its instruction lines}."""
    comps, current = {}, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = comps.setdefault(header["name"], [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return comps


def _called(line: str) -> list[str]:
    names = _CALLED.findall(line)
    for group in _BRANCHES.findall(line):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


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
