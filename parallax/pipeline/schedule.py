"""Pipeline schedules as data: the table representation and the generators (`validate.py` checks them).

A `Schedule` is a table over ticks: at each tick every pipeline rank runs at most one action
`(kind, microbatch, chunk, slot)`. The executor (`parallax/pipeline/executor.py`) runs the table as it is;
the simulator (`simulate.py`) prices it; the renderer (`render.py`) draws it.

Every generator is one list scheduler (`_list_schedule`) with its own per-rank priority: tick by tick,
each rank runs its highest-priority action whose inputs arrived at an earlier tick, either greedily under a
cap on live activation slots (gpipe, 1f1b, zbv) or strictly in priority order, i.e. as a fixed per-rank
program (interleaved_1f1b, zb_h1). Dependencies hold by construction; `validate.validate` re-checks them. Slots are
assigned greedily (lowest free index), so `num_slots` is the peak number of live activations on a rank.

At unit costs (F = B = W = 1, BW = 2) the async bubbles are exactly the published ones: gpipe and 1f1b
(p-1)/(m+p-1), interleaved_1f1b (p-1)/(vm+p-1) (m a multiple of p), zb_h1 (p-1)/(3m+p-1) for m >= p.
zbv reaches, within a few ticks for m >= p, the bound (p-1)/(6m+p-1) that any schedule of 6m unit actions
per rank pays because rank p-1 cannot start before tick p-1. v_half and v_min (ZB-V's placement, the
controllable-memory paper's building blocks) hold about 5/8 and 1/2 of zbv's (1F1B's) peak activations
at p = 8, with bubbles below 1F1B's (`v_schedule`).

A *steady* schedule (`2bw`) is one window of an endless pipeline, run once per training step: there is no
flush, so the microbatches in flight at the window's end finish in the next window. Its table names the
current step's microbatches 0..m-1 and the previous step's -m..-1 (those that were still in flight); run
back to back, the windows are one valid schedule (`unroll`, which `validate.validate` checks).
"""
import dataclasses

import numpy as np

IDLE, F, B, W, BW = 0, 1, 2, 3, 4
KIND_NAMES = ("idle", "F", "B", "W", "BW")


class ScheduleError(ValueError):
    """A schedule that cannot be built or does not hold; the message names the fix."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule.

    table: int32 [ticks, num_ranks, 4] of (kind, microbatch, chunk, slot); `chunk` is the local chunk index
      0..num_chunks-1 on that rank; an idle cell is (IDLE, -1, -1, -1).
    stage_of: int32 [num_ranks, num_chunks]; global stage of local chunk c on rank r. Stages
      0..num_stages-1 run the model's layers in order.
    steady: the table is one window of an endless pipeline (see the module docstring): microbatch -k is
      the previous step's microbatch m-k, and slots (activations) stay live across windows.
    layers: the model's layers per stage, in stage order (an uneven layout, `with_layers`), or None: every
      stage holds num_layers / num_stages. The order of actions does not depend on it.
    pair: None, or int32 like `table`: a second action each rank runs in the same tick, overlapped with the
      first (DualPipeV's F of one microbatch beside the backward of another); idle cells where none.
    """
    name: str
    num_ranks: int
    num_microbatches: int
    num_chunks: int
    table: np.ndarray
    stage_of: np.ndarray
    steady: bool = False
    layers: tuple | None = None
    pair: np.ndarray | None = None

    def __post_init__(self):
        if self.pair is not None and self.pair.shape != self.table.shape:
            raise ScheduleError(f"{self.name}: pair must have the table's shape {self.table.shape}, got "
                                f"{self.pair.shape}")

    @property
    def paired(self) -> bool:
        """True if some tick runs two actions on a rank (`pair`): an F and a backward of other microbatches
        and chunks, overlapped (DualPipeV)."""
        return self.pair is not None and bool(np.any(self.pair[..., 0] != IDLE))

    def serialized(self, pair_first: bool = False) -> "Schedule":
        """This schedule with one action per rank per tick: each tick that pairs two actions on some rank
        becomes two ticks, `table`'s action first (`pair`'s with `pair_first`). Both orders are valid
        schedules exactly when the paired actions are independent (`validate.validate` checks both)."""
        if not self.paired:
            return dataclasses.replace(self, pair=None)
        rows = []
        for t in range(self.num_ticks):
            both = (self.pair[t, :, 0] != IDLE)[:, None]
            first, second = (self.pair[t], self.table[t]) if pair_first else (self.table[t], self.pair[t])
            rows.append(np.where(both, first, self.table[t]))
            if both.any():
                rows.append(np.where(both, second, self.pair[t]))
        table = np.stack(rows).astype(np.int32)
        table = table[(table[..., 0] != IDLE).any(axis=1)]
        return dataclasses.replace(self, table=table, pair=None)

    def with_layers(self, layers) -> "Schedule":
        """This schedule with `layers[s]` layers in stage s (None: even); checked against the stage count."""
        if layers is not None:
            layers = tuple(int(n) for n in layers)
            if len(layers) != self.num_stages or min(layers) < 0 or sum(layers) < 1:
                raise ScheduleError(f"{self.name}: a layout needs one layer count >= 0 per stage ({self.num_stages}: "
                                    f"{self.num_ranks} ranks x {self.num_chunks} chunks), got {list(layers)}")
        return dataclasses.replace(self, layers=layers)

    def stage_layers(self, num_layers: int) -> tuple:
        """Layers per stage, in stage order, for a model of `num_layers` layers."""
        if self.layers is None:
            if num_layers % self.num_stages:
                raise ScheduleError(f"{num_layers} layers do not split evenly into {self.num_stages} pipeline "
                                    f"stages; use a layer count divisible by {self.num_stages} or give "
                                    f"pipeline.layout (layers per stage)")
            return (num_layers // self.num_stages,) * self.num_stages
        if sum(self.layers) != num_layers:
            raise ScheduleError(f"the layout {list(self.layers)} holds {sum(self.layers)} layers, the model "
                                f"{num_layers}; give counts that sum to {num_layers}")
        return self.layers

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_chunks

    @property
    def num_ticks(self) -> int:
        return int(self.table.shape[0])

    @property
    def split_backward(self) -> bool:
        """True if the backward is split into B (input gradient) and W (weight gradient)."""
        return bool(np.any(self.table[..., 0] == W))

    @property
    def num_slots(self) -> int:
        """Activation slots per rank the executor must allocate (max slot index + 1)."""
        return int(self.table[..., 3].max(initial=-1)) + 1

    def rank_of_stage(self, stage: int) -> tuple[int, int]:
        """(rank, local chunk) that runs global stage `stage`."""
        r, c = np.argwhere(self.stage_of == stage)[0]
        return int(r), int(c)


def balanced_layers(num_layers: int, num_stages: int, layer: float, first: float = 0.0, last: float = 0.0) -> tuple:
    """Layers per stage (stage order) that minimise the largest stage cost `n * layer + extra`, where stage 0
    also pays `first` (the embedding) and the last stage `last` (the head and loss): the smallest bound T
    whose per-stage capacities `floor((T - extra) / layer)` hold every layer, then the surplus taken off
    the costliest stages, the earliest of equals (early ranks hold the most activations in flight under
    1F1B-like schedules). A stage may get no layers."""
    extra = np.zeros(num_stages)
    extra[0] += first
    extra[-1] += last
    if layer <= 0:
        return (num_layers // num_stages + 1,) * (num_layers % num_stages) + \
            (num_layers // num_stages,) * (num_stages - num_layers % num_stages)
    bounds = sorted({n * layer + e for e in extra for n in range(num_layers + 1)})

    def caps(t):
        return np.floor((t - extra) / layer + 1e-9).clip(min=-1).astype(int)
    t = next(t for t in bounds if (caps(t) >= 0).all() and caps(t).sum() >= num_layers)
    n = caps(t)
    for _ in range(int(n.sum()) - num_layers):
        cost = np.where(n > 0, n * layer + extra, -np.inf)
        n[int(np.argmax(cost))] -= 1
    return tuple(int(a) for a in n)


def action_str(kind, mb, chunk) -> str:
    return f"{KIND_NAMES[kind]}(mb={mb}, chunk={chunk})"


# ----------------------------------------------------------------------------------------------------
# Generators.


def _list_schedule(name, num_microbatches, stage_of, split, priority, cap=None, in_order=False) -> Schedule:
    """Greedy list scheduling: each tick, each rank runs its ready action with the smallest
    `priority(rank, kind, mb, chunk)`, running F only while it holds fewer than `cap[rank]` live slots.
    `stage_of` is int [ranks, chunks]; `split` chooses B + W over a fused BW.
    Per stage, F, B and W each run in microbatch order. With `in_order`, `priority` is a program: a rank
    runs its actions strictly in priority order, waiting while the next one is not ready."""
    m = num_microbatches
    p, v = stage_of.shape
    last = p * v - 1
    never = np.iinfo(np.int64).max
    f_tick = np.full((m, p * v), never)  # tick of F(mb, stage)
    g_tick = np.full((m, p * v), never)  # tick of B or BW(mb, stage): its input gradient is then sent
    next_f = np.zeros((p, v), int)
    next_g = np.zeros((p, v), int)
    next_w = np.zeros((p, v), int)
    live = np.zeros(p, int)
    slots = [dict() for _ in range(p)]  # per rank: (mb, chunk) -> slot
    g_kind = B if split else BW
    rows = []

    def is_ready(r, kind, mb, s, t):
        if kind == F:
            return (cap is None or live[r] < cap[r]) and (s == 0 or f_tick[mb, s - 1] < t)
        if kind == W:
            return g_tick[mb, s] < t
        return f_tick[mb, s] < t and (s == last or g_tick[mb, s + 1] < t)

    while (next_w if split else next_g).min() < m:
        t = len(rows)
        row = np.tile(np.array([IDLE, -1, -1, -1], np.int32), (p, 1))
        for r in range(p):
            heads = [(kind, nxt[r, c], c) for kind, nxt in ((F, next_f), (g_kind, next_g), (W, next_w))
                     for c in range(v) if nxt[r, c] < m and (split or kind != W)]
            if in_order:
                heads = [min(heads, key=lambda a: priority(r, *a))] if heads else []
            ready = [(kind, mb, c) for kind, mb, c in heads if is_ready(r, kind, mb, stage_of[r, c], t)]
            if not ready:
                continue
            kind, mb, c = min(ready, key=lambda a: priority(r, *a))
            s = stage_of[r, c]
            if kind == F:
                used = set(slots[r].values())
                slots[r][mb, c] = min(i for i in range(len(used) + 1) if i not in used)
                f_tick[mb, s] = t
                next_f[r, c] += 1
                live[r] += 1
            elif kind == W:
                next_w[r, c] += 1
            else:
                g_tick[mb, s] = t
                next_g[r, c] += 1
            row[r] = (kind, mb, c, slots[r][mb, c])
            if kind in (W, BW):
                del slots[r][mb, c]
                live[r] -= 1
        if (row[:, 0] == IDLE).all():
            raise RuntimeError(f"{name}: list scheduler stalled at tick {t}: slot cap {cap} too small or "
                               f"program order not executable")
        rows.append(row)
    return Schedule(name, p, m, v, np.stack(rows).astype(np.int32), stage_of.astype(np.int32))


def _linear_stages(p):
    return np.arange(p).reshape(p, 1)


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every fused backward. Holds all m activations."""
    p, m = num_ranks, num_microbatches
    return _list_schedule("gpipe", m, _linear_stages(p), False,
                          lambda r, kind, mb, c: (kind != F, mb), [m] * p)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): p-r-1 warmup forwards on rank r, then one forward / one fused backward,
    then the cooldown backwards. Rank r holds at most p-r activations."""
    p, m = num_ranks, num_microbatches
    return _list_schedule("1f1b", m, _linear_stages(p), False,
                          lambda r, kind, mb, c: (kind == F, mb), [p - r for r in range(p)])


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron interleaved 1F1B: rank r holds chunks c = 0..v-1 of stages c*p + r. Microbatches go
    through in groups of p per chunk (backward: chunks in reverse); each rank runs Megatron's program:
    2(p-r-1) + (v-1)p warmup forwards, then one forward / one fused backward, then the cooldown."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    stage_of = np.arange(p * v).reshape(v, p).T  # stage_of[r, c] = c*p + r

    def program(r, kind, mb, c):
        chunk = c if kind == F else v - 1 - c
        k = (mb // p) * p * v + chunk * p + mb % p  # index in the rank's forward (or backward) sequence
        warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
        if kind == F:
            return (-1, k) if k < warmup else (k - warmup, 0)
        return (k, 1)

    return _list_schedule("interleaved_1f1b", m, stage_of, False, program, in_order=True)


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero bubble at 1F1B memory): backward split into B and W. Rank r runs p-r warmup forwards,
    then rounds of (B, W, F) whose W lags its B by r microbatches, so rank r holds at most p activations
    and the W's fill the ticks 1F1B would idle."""
    p, m = num_ranks, num_microbatches

    def program(r, kind, mb, c):
        warmup = min(p - r, m)
        if kind == F:
            return (-1, mb) if mb < warmup else (mb - warmup, 2)
        return (mb, 0) if kind == B else (mb + r, 1)

    return _list_schedule("zb_h1", m, _linear_stages(p), True, program, in_order=True)


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r), split B and W. Greedy: B
    first (it unblocks the ranks upstream), then F (later chunk first) while fewer than 2p chunk
    activations are live (1F1B's memory: a chunk is half a stage), and W fills the remaining ticks."""
    p, m = num_ranks, num_microbatches
    stage_of = np.stack([np.arange(p), 2 * p - 1 - np.arange(p)], axis=1)
    return _list_schedule("zbv", m, stage_of, True,
                          lambda r, kind, mb, c: ((B, F, W).index(kind), mb, -c), [2 * p] * p)


def _v_pattern(name: str, p: int) -> list[tuple[int, int, int, int]]:
    """The repeating building block of a V schedule (Qi et al., "Pipeline Parallelism with Controllable
    Memory", arXiv 2405.15362): per rank, the ticks of microbatch 0's (F chunk 0, F chunk 1, B chunk 1,
    B chunk 0) in a period of 6 ticks per microbatch (F, B and W of two chunks). The block's lifespan on a
    rank sets its peak activations: V-Min about 1/3 of 1F1B's, V-Half about 1/2."""
    if name == "v_min":
        gap = 2 if p % 3 == 0 else 0  # the block's gap that keeps two ranks' actions off one tick
        return [(r, 2 * p - r - 1, 2 * p + gap + r, 4 * p + gap - r - 1) for r in range(p)]
    gap = 3 if p % 2 == 0 else 0
    return [(2 * r, 3 * p - r - 2, 3 * p + gap + 2 * r - 1, 6 * p + gap - r - 2) for r in range(p)]


def v_schedule(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min / V-Half: two chunks per rank in ZB-V's V placement (rank r holds stages r and 2p-1-r), split
    B and W, each rank running a fixed program: the building block of `_v_pattern` repeated every 6 ticks
    (microbatch j's actions at the block's ticks + 6j), each W in the first tick its rank leaves free after
    its B (chunk 1's first), then squeezed: the list scheduler runs the program in that order, each action
    as soon as its inputs arrived. The order, hence the peak of live activations, is the block's; the
    squeeze removes the block's idle ticks in the warmup and cooldown."""
    p, m = num_ranks, num_microbatches
    stage_of = np.stack([np.arange(p), 2 * p - 1 - np.arange(p)], axis=1)
    order = {}  # (rank, kind, mb, chunk) -> position in the rank's program
    for r, (f0, f1, b1, b0) in enumerate(_v_pattern(name, p)):
        timed = {t + 6 * j: (kind, j, c) for j in range(m) for t, kind, c in ((f0, F, 0), (f1, F, 1), (b1, B, 1),
                                                                              (b0, B, 0))}
        pending = [[], []]  # W's waiting for a free tick, per chunk
        tick, program = 0, []
        while len(program) < 6 * m:
            if tick in timed:
                kind, j, c = timed[tick]
                program.append((kind, j, c))
                if kind == B:
                    pending[c].append(j)
            else:
                c = 1 if pending[1] else 0
                if pending[c]:
                    program.append((W, pending[c].pop(0), c))
            tick += 1
        order.update({(r, *a): i for i, a in enumerate(program)})
    return _list_schedule(name, m, stage_of, True, lambda r, kind, mb, c: order[r, kind, mb, c], in_order=True)


def _dualpipev_programs(p: int, m: int) -> list[list[tuple]]:
    """Each rank's program in DualPipeV (the "cut-in-half" DualPipe, DeepSeek's `dualpipev.py`): items of
    one action `(kind, mb, chunk)` or two run overlapped. Chunk 0 is stage r, chunk 1 stage 2p-1-r. Rank r
    runs: 2(p-r-1) F0; r+1 (F0, F1); p-r-1 (B1, W1, F1); m-2p+r+1 (F0 & BW1, F1 & BW0) -- the overlapped main
    part (the last rank runs its first F0 and BW1 apart, as the reference does, to shorten the bubble);
    p-r-1 (BW1, F1 & BW0); r+1 (B1, B0), fused backwards in the first half and split in the second; p-r-1
    (W, B0); then the r+1 W's left. Each chunk runs its forwards and its backwards in microbatch order; W's
    run in the order of their B's."""
    programs = []
    for r in range(p):
        prog, nf, nb, pending = [], [0, 0], [0, 0], []

        def f(c):
            nf[c] += 1
            return (F, nf[c] - 1, c)

        def b(c, split):
            nb[c] += 1
            if split:
                pending.append((W, nb[c] - 1, c))
            return (B if split else BW, nb[c] - 1, c)

        def one(*actions):
            prog.extend((a,) for a in actions)
        one(*(f(0) for _ in range(2 * (p - r - 1))))
        for _ in range(r + 1):
            one(f(0), f(1))
        for _ in range(p - r - 1):
            one(b(1, True), pending.pop(0), f(1))
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                one(f(0), b(1, False))
            else:
                prog.append((f(0), b(1, False)))
            prog.append((f(1), b(0, False)))
        for _ in range(p - r - 1):
            one(b(1, False))
            prog.append((f(1), b(0, False)))
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            one(b(1, split))
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            one(b(0, split))
        for _ in range(p - r - 1):
            one(pending.pop(0), b(0, True))
        one(*pending)
        programs.append(prog)
    return programs


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV: ZB-V's V placement (rank r holds stages r and 2p-1-r), each rank running DeepSeek's
    program (`_dualpipev_programs`) strictly in order, each item as soon as its inputs arrived at an earlier
    tick. In its main part a tick holds two actions on a rank (`Schedule.pair`): the forward of one chunk
    beside the fused backward of the other chunk for another microbatch, which share no data, so that one's
    communication can hide behind the other's compute. Needs m >= 2p."""
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs microbatches >= 2 x stages ({2 * p}), got {m}; set "
                            f"microbatches={2 * p}")
    stage_of = np.stack([np.arange(p), 2 * p - 1 - np.arange(p)], axis=1)
    programs = _dualpipev_programs(p, m)
    done = {}  # (kind, mb, stage) -> tick; a backward is recorded as B whether split or fused
    slots = [dict() for _ in range(p)]
    pos = [0] * p
    idle = np.array([IDLE, -1, -1, -1], np.int32)
    rows, pairs = [], []

    def ready(r, kind, mb, c, t):
        s = int(stage_of[r, c])
        if kind == F:
            return s == 0 or done.get((F, mb, s - 1), t) < t
        if kind == W:
            return done.get((B, mb, s), t) < t
        return done.get((F, mb, s), t) < t and (s == 2 * p - 1 or done.get((B, mb, s + 1), t) < t)

    while any(pos[r] < len(programs[r]) for r in range(p)):
        t = len(rows)
        row, pair = np.tile(idle, (p, 1)), np.tile(idle, (p, 1))
        for r in range(p):
            if pos[r] == len(programs[r]) or not all(ready(r, *a, t) for a in programs[r][pos[r]]):
                continue
            item, pos[r] = programs[r][pos[r]], pos[r] + 1
            for lane, (kind, mb, c) in zip((row, pair), item):  # slots taken before any is freed
                if kind == F:
                    used = set(slots[r].values())
                    slots[r][mb, c] = min(i for i in range(len(used) + 1) if i not in used)
                lane[r] = (kind, mb, c, slots[r][mb, c])
            for kind, mb, c in item:
                done[F if kind == F else W if kind == W else B, mb, int(stage_of[r, c])] = t
                if kind in (W, BW):
                    del slots[r][mb, c]
        if all(row[:, 0] == IDLE):
            raise RuntimeError(f"dualpipev: program stalled at tick {t} (p={p}, m={m})")
        rows.append(row)
        pairs.append(pair)
    return Schedule("dualpipev", p, m, 2, np.stack(rows).astype(np.int32), stage_of.astype(np.int32),
                    pair=np.stack(pairs).astype(np.int32))


def circular_colouring(busy, period: int) -> list[int]:
    """Colours for intervals on a circle of `period` ticks: `busy[i]` is the list of ticks item i holds its
    colour (an activation slot, an inbox entry), taken mod `period`; items that share a tick get different
    colours. Keeps the colouring with the fewest colours of: greedy in several orders (longest first, and
    by start tick from each cut of the circle), and the round robin over C colours in start order with the
    smallest C that has no clash (what evenly spaced items, a steady schedule's, need: greedy can use more
    colours than items live at once on a circle)."""
    ticks = [{t % period for t in b} for b in busy]
    for b, held in zip(busy, ticks):
        if len(held) < len(b):
            raise ScheduleError(f"an item is held for {len(b)} ticks, longer than the window of {period}")
    orders = [sorted(range(len(busy)), key=lambda i: -len(busy[i]))]
    orders += [sorted(range(len(busy)), key=lambda i: ((busy[i][0] - cut) % period, -len(busy[i])))
               for cut in range(period)]
    best = None
    for order in orders:
        held, colour = [], [0] * len(busy)  # held[c]: the ticks colour c is taken
        for i in order:
            c = next((c for c, h in enumerate(held) if not h & ticks[i]), len(held))
            if c == len(held):
                held.append(set())
            held[c] |= ticks[i]
            colour[i] = c
        if best is None or len(held) < best[0]:
            best = len(held), colour
    by_start = sorted(range(len(busy)), key=lambda i: busy[i][0])
    for n in range(1, best[0]):
        held = [set() for _ in range(n)]
        for k, i in enumerate(by_start):
            if held[k % n] & ticks[i]:
                break
            held[k % n] |= ticks[i]
        else:
            colour = [0] * len(busy)
            for k, i in enumerate(by_start):
                colour[i] = k % n
            return colour
    return best[1]


def two_bw(num_ranks: int, num_microbatches: int) -> Schedule:
    """PipeDream-2BW's steady state: one step's window of an endless 1F1B pipeline (no flush). Each rank
    alternates F and a fused BW, so the window of 2m ticks has no idle tick; it runs the current step's
    forwards and the previous step's microbatches that were still in flight (ids -m..-1), which use the
    previous weights, the ones their forwards used. Needs m >= p, so that the previous step's microbatches
    all finish within the window.

    Built by list-scheduling 1F1B over many steps' microbatches without a flush and cutting one period out
    of its steady state (from stage 0's first forward of a step to that of the next); the activation slots
    are then recoloured on the circle of the window, so that they repeat from window to window."""
    p, m = num_ranks, num_microbatches
    if m < p:
        raise ScheduleError(f"2bw needs microbatches >= stages so that a step's in-flight microbatches finish "
                            f"in the next step, got microbatches={m} stages={p}; set microbatches={p}")
    steps = 6
    table = one_f_one_b(p, steps * m).table

    def window(b):  # stage 0 runs F(b * m) first in step b
        start = [int(np.argwhere((table[:, 0, 0] == F) & (table[:, 0, 1] == k * m))[0, 0]) for k in (b, b + 1)]
        w = table[start[0]:start[1]].copy()
        busy = w[..., 0] != IDLE
        w[..., 1] = np.where(busy, w[..., 1] - b * m, -1)
        return w
    w = window(steps // 2)
    busy = w[..., 0] != IDLE
    if not np.array_equal(w[..., :3], window(steps // 2 - 1)[..., :3]) or not busy.all() or \
            w[..., 1][busy].min() < -m or w[..., 1].max() >= m:
        raise RuntimeError(f"2bw: no periodic steady state of 1F1B found for p={p} m={m}")
    n = len(w)
    for r in range(p):
        def at(kind, mb):
            return [t for t in range(n) if w[t, r, 0] == kind and w[t, r, 1] == mb]
        f_at = {int(w[t, r, 1]): t for t in range(n) if w[t, r, 0] == F}
        span = []  # per F: the ticks its activation is held, F .. BW (in this window or the next)
        for mb, f in f_at.items():
            same = at(BW, mb)
            span.append(list(range(f, same[0] + 1)) if same else list(range(f, at(BW, mb - m)[0] + n + 1)))
        colour = dict(zip(f_at, circular_colouring(span, n)))
        for t in range(n):
            kind, mb = int(w[t, r, 0]), int(w[t, r, 1])
            if kind == F:
                w[t, r, 3] = colour[mb]
            elif kind == BW:  # its F ran in this window, or in the previous one as microbatch mb + m
                w[t, r, 3] = colour[mb] if f_at.get(mb, n) < t else colour[mb + m]
    return Schedule("2bw", p, m, 1, w.astype(np.int32), _linear_stages(p).astype(np.int32), steady=True)


def unroll(schedule: Schedule, windows: int = 3) -> Schedule:
    """A steady schedule run `windows` times back to back, as a plain schedule: the microbatches of steps
    0..windows-2 renumbered 0..(windows-1)*m-1 (the last step's are still in flight and dropped, and so
    are the ones in flight before the first window)."""
    s, m = schedule, schedule.num_microbatches
    parts = []
    for k in range(windows):
        w = s.table.copy()
        mb = w[..., 1] + k * m
        keep = (w[..., 0] != IDLE) & (mb >= 0) & (mb < (windows - 1) * m)
        w[..., 1] = mb
        w[~keep] = (IDLE, -1, -1, -1)
        parts.append(w)
    return Schedule(f"{s.name} x{windows}", s.num_ranks, (windows - 1) * m, s.num_chunks,
                    np.concatenate(parts).astype(np.int32), s.stage_of)


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """What the checks, the executor, the step paths, the simulator, the bench and the docs know of a named
    schedule: the one entry (`KINDS`) that spells its name.

    build: (num_ranks, num_microbatches) -> Schedule, or (p, m, virtual_stages) with `chunks` None.
    chunks: chunks (stages) per rank, or None: `pipeline.virtual_stages` of them (at least 2).
    min_microbatches: (num_ranks) -> the fewest microbatches it runs.
    ranks_divide_microbatches: microbatches must be a multiple of the ranks.
    steady: one window of an endless pipeline per step (no flush: see the module docstring).
    pairs: a tick may hold two actions on a rank (`Schedule.pair`).
    flushing_twin: for a steady schedule, the flushing schedule with its placement, run where a step must
      end with nothing in flight (eval).
    summary: one line for the docs and the flags.
    """
    name: str
    build: object
    chunks: int | None = 1
    min_microbatches: object = lambda p: 1
    ranks_divide_microbatches: bool = False
    steady: bool = False
    pairs: bool = False
    flushing_twin: str | None = None
    summary: str = ""

    @property
    def flushes(self) -> bool:
        return not self.steady

    def virtual_stages(self, requested: int = 2) -> int:
        """The `pipeline.virtual_stages` it runs with: its fixed chunk count, else `requested`."""
        return self.chunks if self.chunks is not None else requested


KINDS = {k.name: k for k in (
    ScheduleKind("gpipe", gpipe, summary="all forwards, then all backwards"),
    ScheduleKind("1f1b", one_f_one_b, summary="one forward, one backward: p - 1 live microbatches"),
    ScheduleKind("interleaved_1f1b", interleaved_1f1b, chunks=None, ranks_divide_microbatches=True,
                 summary="1F1B over v chunks per rank (Megatron's interleaving)"),
    ScheduleKind("zb_h1", zb_h1, summary="zero bubble H1: the backward split into B and W"),
    ScheduleKind("zbv", zbv, chunks=2, summary="zero bubble V: two chunks per rank in a V"),
    ScheduleKind("v_half", lambda p, m: v_schedule("v_half", p, m), chunks=2,
                 summary="V placement at about half of 1F1B's activation memory"),
    ScheduleKind("v_min", lambda p, m: v_schedule("v_min", p, m), chunks=2,
                 summary="V placement at the least activation memory"),
    ScheduleKind("dualpipev", dualpipev, chunks=2, min_microbatches=lambda p: 2 * p, pairs=True,
                 summary="DeepSeek's DualPipeV: a forward beside another microbatch's backward"),
    ScheduleKind("2bw", two_bw, steady=True, flushing_twin="1f1b",
                 summary="PipeDream-2BW: an endless 1F1B, each gradient applied one step late"),
)}
DEFAULT = "1f1b"  # `pipeline.schedule`'s default
# The flushing schedules (a step ends with nothing in flight) and the steady ones, by name.
SCHEDULES = {name: k.build for name, k in KINDS.items() if k.flushes}
STEADY_SCHEDULES = {name: k.build for name, k in KINDS.items() if k.steady}


def schedule_kind(name: str) -> ScheduleKind:
    """The registry entry of schedule `name`; raises ScheduleError naming the valid ones."""
    if name not in KINDS:
        raise ScheduleError(f"unknown schedule {name!r}; set one of {', '.join(KINDS)}")
    return KINDS[name]


def names(steady: bool | None = None) -> tuple:
    """Schedule names in registry order (`steady`: only those that are / are not steady)."""
    return tuple(n for n, k in KINDS.items() if steady is None or k.steady == steady)


def make_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Builds schedule `name` for `num_ranks` pipeline ranks; raises ScheduleError naming the fix."""
    kind = schedule_kind(name)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if p < 1 or m < 1:
        raise ScheduleError(f"{name}: need stages >= 1 and microbatches >= 1, got stages={p} "
                            f"microbatches={m}")
    if kind.chunks is None:
        if v < 2:
            raise ScheduleError(f"{name} needs virtual_stages >= 2, got {v}; set virtual_stages=2")
        if kind.ranks_divide_microbatches and m % p:
            raise ScheduleError(f"{name} needs microbatches a multiple of stages={p}, got {m}; "
                                f"set microbatches={-(-m // p) * p}")
        return kind.build(p, m, v)
    if kind.chunks > 1:
        if v not in (1, kind.chunks):
            raise ScheduleError(f"{name} always holds {kind.chunks} chunks per rank, got virtual_stages={v}; set "
                                f"it to {kind.chunks}")
    elif v != 1:
        variable = [n for n, k in KINDS.items() if k.chunks is None]
        raise ScheduleError(f"{name} holds one chunk per rank, got virtual_stages={v}; set it to 1 or use "
                            f"{' or '.join(variable)}")
    return kind.build(p, m)  # a generator refuses too few microbatches itself (`min_microbatches` says how many)
