"""docs/pipeline.md's tables of unit-cost figures, printed from the code: every schedule's bubbles
(`simulate.bubble_table`), the choice between schedules, the messages moved per step and DualPipeV beside the
DualPipe paper's formula. Costs F = B = W = 1 and BW = 2 throughout; nothing is compiled.

    python -m parallax.pipeline.tables      # the four tables, as they stand on the page

`tests/test_docs.py` holds the page to what this prints.
"""
import numpy as np

from parallax.pipeline.program import compile_schedule
from parallax.pipeline.schedule import KINDS, make_schedule
from parallax.pipeline.simulate import bubble_table, format_bubble_table, simulate
from parallax.pipeline.work import messages_moved

FULL_OVERLAP = {"FB": 2.0}  # a dualpipev pair costing one F + one B (its F and backward fully overlapped)
MESSAGE_KIB = 256  # the bench's message: 4 rows x 128 tokens x d_model 128 x fp32


def _flushing():
    return [(name, kind) for name, kind in KINDS.items() if not kind.steady]


def _schedule(name, p, m):
    return make_schedule(name, p, m, KINDS[name].virtual_stages(2))


def _holder(s, stage):
    """'rank 0' / 'rank p-1': the rank holding `stage`, named relative to the last rank."""
    rank = int(np.argwhere(s.stage_of == stage)[0, 0])
    return "rank p-1" if rank == s.num_ranks - 1 and rank else f"rank {rank}"


def choice_table(sizes=((4, 8), (8, 32))) -> str:
    """The schedules side by side: the lockstep bubble (the async one where it differs; dualpipev also with
    its pairs fully overlapped) at each (p, m) of `sizes`, the busiest rank's activations in full-stage
    microbatches (1F1B's units) at each p, the messages moved per step at the last size, and the ranks that
    hold the embedding and the head."""
    (p0, m0), (p1, m1) = sizes
    lines = [f"| schedule | bubble p={p0}, m={m0} | bubble p={p1}, m={m1} | activations p={p0} / p={p1} | "
             f"messages p={p1}, m={m1} | embedding / head on |", "|---|---|---|---|---|---|"]
    for name, kind in _flushing():
        cells, held = [], []
        for k, (p, m) in enumerate(sizes):
            s = _schedule(name, p, m)
            lock, asyn = simulate(s), simulate(s, mode="async")
            extra = [f"{'async ' if k == 0 else ''}{asyn.bubble:.3f}"] if asyn.bubble != lock.bubble else []
            if kind.pairs:
                extra.append(f"FB=2: {simulate(s, FULL_OVERLAP).bubble:.3f}")
            cells.append(f"{lock.bubble:.3f}" + (f" ({'; '.join(extra)})" if extra else ""))
            held.append(f"{lock.peak_slots / s.num_chunks:g}")
        moved = messages_moved(compile_schedule(s))
        first, last = _holder(s, 0), _holder(s, s.stage_of.size - 1)
        where = f"both on {first}" if first == last else f"{first} / {last}"
        lines.append(f"| {name} | {' | '.join(cells)} | {' / '.join(held)} | {moved['sent']} | {where} |")
    return "\n".join(lines)


def messages_table(p: int = 4, m: int = 8) -> str:
    """Messages moved between pipeline ranks in one step (`work.messages_moved`): both ring permutes on every
    tick (the executor before send patterns) against one permute per send pattern, which moves exactly the
    messages the schedule consumes; in MiB at the bench's message size."""
    lines = ["| schedule | both ring permutes every tick (before) | sent now = needed | bench size, before -> now |",
             "|---|---|---|---|"]
    for name, _ in _flushing():
        moved = messages_moved(compile_schedule(_schedule(name, p, m)))
        assert moved["sent"] == moved["needed"], (name, moved)  # what tests/test_pipeline_executor.py checks
        before, now = (moved[k] * MESSAGE_KIB / 1024 for k in ("every_tick", "sent"))
        lines.append(f"| {name} | {moved['every_tick']} | {moved['sent']} | {before:.1f} -> {now:.1f} MiB |")
    return "\n".join(lines)


def _short(x: float) -> str:
    text = f"{x:.2f}"
    return text[:-1] if text.endswith("0") else text


def dualpipev_table(sizes=((2, 4), (4, 8), (8, 16), (8, 32))) -> str:
    """DualPipeV next to the DualPipe paper's table: the async bubble time per rank (the makespan less the
    rank's work, averaged over ranks) without overlap (a pair costs F + BW = 3) and with full overlap (2),
    each beside the paper's (PP/2 - 1)(F&B + B - 3W) with PP = 2p, B = 2, W = 1; the lockstep makespans;
    zbv's; the activation slots (chunks) and chunks of parameters per rank beside zbv's."""
    lines = ["| p, m | bubble time async (paper) F&B = 3 | F&B = 2 (full overlap) | makespan lockstep F&B = 3 / 2 | "
             "zbv makespan | activation slots (chunks) | parameters per rank |", "|---|---|---|---|---|---|---|"]
    for p, m in sizes:
        s, zbv = make_schedule("dualpipev", p, m, 2), make_schedule("zbv", p, m, 2)
        bubbles = []
        for fb, costs in ((3, None), (2, FULL_OVERLAP)):
            sim = simulate(s, costs, mode="async")
            bubbles.append(f"{_short(sim.total_time - sim.busy_time / p)} ({(p - 1) * (fb + 2 - 3 * 1)})")
        lock = [f"{simulate(s, costs).total_time:g}" for costs in (None, FULL_OVERLAP)]
        z = simulate(zbv)
        chunks = f"{s.num_chunks} chunks" + (", as zbv" if s.num_chunks == zbv.num_chunks else "")
        lines.append(f"| {p}, {m} | {' | '.join(bubbles)} | {' / '.join(lock)} | {z.total_time:g} | "
                     f"{simulate(s).peak_slots} (zbv {z.peak_slots}) | {chunks} |")
    return "\n".join(lines)


def main():
    for title, table in (("Bubbles (p = 4)", format_bubble_table(bubble_table()).split("\n\n")[0]),
                         ("Choosing a schedule", choice_table()), ("Messages moved per step, p = 4, m = 8",
                                                                   messages_table()),
                         ("DualPipeV and the DualPipe paper", dualpipev_table())):
        print(f"{title}:\n\n{table}\n")


if __name__ == "__main__":
    main()
