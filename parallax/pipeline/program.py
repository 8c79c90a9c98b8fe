"""Lowering a schedule for the executor: per-tick, per-rank integer instructions (numpy, ahead of time).

`compile_schedule` turns a `Schedule` table into a `Program`: for each tick and rank, which switch branch
to run, on which microbatch / local chunk / activation slot, which inbox entry holds its input, and into
which inbox entries the messages that arrive this tick go. `parallax.pipeline.executor` runs it; `Op`
(the instruction set) and `Field` (an instruction's fields) are the vocabulary the two modules share.
"""
import dataclasses
import enum

import numpy as np

from parallax.pipeline.schedule import B, BW, F, IDLE, W, Schedule, circular_colouring, unroll


class Op(enum.IntEnum):
    """The executor's instruction set: the branches of its per-tick switch. `*_FIRST` variants hold stage 0
    (they also run `first_fn` or its pullback); `F_LAST` holds the last stage (it also runs `last_fn` and
    its pullback, which seeds the backward)."""
    IDLE = 0
    F = 1
    F_FIRST = 2
    F_LAST = 3
    B = 4
    B_FIRST = 5
    W = 6
    BW = 7
    BW_FIRST = 8


class Field(enum.IntEnum):
    """Fields of one lowered instruction. Inbox indices (`IN`, `LOCAL`, `FROM_UP`, `FROM_DOWN`) are -1 where
    nothing is read or written. `VERSION` is which weights the action uses: 0 for every schedule but a
    steady one (2bw), where it is 0 for the previous step's microbatches (the previous weights) and 1 for the
    current step's."""
    BRANCH = 0
    MB = 1
    CHUNK = 2
    SLOT = 3
    IN = 4
    LOCAL = 5
    FROM_UP = 6
    FROM_DOWN = 7
    VERSION = 8


NUM_FIELDS = len(Field)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A schedule lowered for the executor.

    code: int32 [ticks, p, NUM_FIELDS] instructions (`Field`); `code[..., Field.BRANCH]` indexes `branches`,
      the switch branches this schedule uses.
    inbox_size: entries of the per-rank inbox that buffers activations and output cotangents from their
      arrival until their last use (bounded by the schedule, not by the number of microbatches for
      1F1B-like schedules).
    num_slots: per-rank activation slots (residuals, or chunk inputs with remat).
    up_perm / down_perm: `ppermute` pairs for messages to rank r+1 / r-1 (mod p); empty if unused.
    steady: the program of a steady schedule (2bw): `code[..., Field.MB]` indexes 2m microbatches (the
      previous step's, then the current step's), and the slots and the inbox are carried from one step's
      program to the next (a message or an activation may outlive the window).
    pair_code: None, or a paired schedule's (dualpipev) backward actions, like `code`, which then holds its
      forward actions alone (`_forward_and_backward_lanes`): a tick's two run in one switch branch, so that
      neither waits for the other's communication; each lane's messages move by their own permutes, and
      `FROM_UP` / `FROM_DOWN` of a lane place the messages the neighbours' same lane sent.
    """
    code: np.ndarray
    branches: tuple[int, ...]
    inbox_size: int
    num_slots: int
    up_perm: tuple[tuple[int, int], ...]
    down_perm: tuple[tuple[int, int], ...]
    steady: bool = False
    pair_code: np.ndarray | None = None

    @property
    def num_versions(self) -> int:
        """Weight versions the program reads: 2 for a steady schedule, else 1."""
        return 2 if self.steady else 1

    @property
    def num_ticks(self) -> int:
        return int(self.code.shape[0])

    def pair_branches(self):
        """With `pair_code`: (int [ticks, p], the index of each rank's pair of branches in the list; the list
        of distinct pairs (branch, paired branch)): the switch branches of a paired program."""
        pairs = np.stack([self.code[..., Field.BRANCH], self.pair_code[..., Field.BRANCH]], axis=-1)
        combos, index = np.unique(pairs.reshape(-1, 2), axis=0, return_inverse=True)
        return index.reshape(pairs.shape[:2]).astype(np.int32), [tuple(int(x) for x in c) for c in combos]

    def send_patterns(self, direction: str, lane: int = 0):
        """(pattern per tick, patterns) of the messages moving `direction` ("up": rank r -> r+1, "down":
        r -> r-1): patterns are the distinct sets of (source, destination) pairs that send on some tick,
        and the tick's entry is 0 when nothing moves that way, else 1 + the index of its pattern. The
        executor runs one `ppermute` per pattern, each only on its ticks, so every message it moves is one
        the schedule uses. `lane` 1: the messages of the paired actions (`pair_code`)."""
        field, shift = (Field.FROM_UP, -1) if direction == "up" else (Field.FROM_DOWN, 1)
        code = self.code if lane == 0 else self.pair_code
        p = code.shape[1]
        index, patterns = np.zeros(self.num_ticks, np.int32), {}
        for t in range(self.num_ticks):
            pairs = tuple(((dst + shift) % p, dst) for dst in np.flatnonzero(code[t, :, field] >= 0).tolist())
            if pairs:
                index[t] = patterns.setdefault(pairs, len(patterns)) + 1
        return index, tuple(patterns)


def compile_schedule(schedule: Schedule, forward_only: bool = False, serialize: bool = False) -> Program:
    """Lowers `schedule` into executor instructions; raises ValueError if the executor cannot run it.

    `forward_only` keeps only the F actions, in their order and places, and drops the ticks left idle on
    every rank: the program of an evaluation (the last stage's F computes the loss and sends nothing); a
    schedule's paired actions then run one after the other. `serialize` does that for training too (the
    executor then runs one action per tick).
    """
    if schedule.pair is not None and (forward_only or serialize):  # either order of a pair is valid
        schedule = schedule.serialized()
    s, table = schedule, schedule.table
    if s.num_stages < 2:
        raise ValueError(f"{s.name}: the pipeline executor needs at least 2 stages, got {s.num_stages}; "
                         f"use pipe >= 2 or call jax.value_and_grad directly")
    if s.steady:
        if forward_only:
            raise ValueError(f"{s.name}: a steady schedule has no forward-only program; evaluate with a flushing "
                             f"schedule of the same shape (1f1b)")
        return _compile_steady(s)
    if forward_only:
        table = np.where(table[..., :1] == F, table, np.array([IDLE, -1, -1, -1], table.dtype))
        table = table[(table[..., 0] != IDLE).any(axis=1)]
    lanes = [table] if s.pair is None else _forward_and_backward_lanes(s)
    msgs = _messages(s, lanes, forward_only)
    entry, inbox_size = _inbox_entries(msgs, s.num_ranks)
    codes, up, down = zip(*(_instructions(s, lane, msgs, entry, forward_only) for lane in lanes))
    branches = tuple(sorted(set(np.concatenate([c[..., Field.BRANCH].ravel() for c in codes]).tolist()) | {Op.IDLE}))
    for code in codes:
        code[..., Field.BRANCH] = np.searchsorted(np.array(branches), code[..., Field.BRANCH])
    return Program(codes[0], branches, inbox_size, s.num_slots, tuple(sorted(set().union(*up))),
                   tuple(sorted(set().union(*down))), pair_code=codes[1] if len(codes) > 1 else None)


def _forward_and_backward_lanes(s: Schedule):
    """A paired schedule's actions as two tables: every F in the first, every B / W / BW in the second (the
    executor's paired branch returns the forward's activation and the backward's cotangents and weight
    gradients, one of each). Raises ValueError where a tick pairs two of a kind."""
    idle = np.array([IDLE, -1, -1, -1], s.table.dtype)
    fwd = [np.where(lane[..., :1] == F, lane, idle) for lane in (s.table, s.pair)]
    bwd = [np.where((lane[..., :1] != F) & (lane[..., :1] != IDLE), lane, idle) for lane in (s.table, s.pair)]
    for kind, (a, b) in (("forwards", fwd), ("backwards", bwd)):
        clash = (a[..., 0] != IDLE) & (b[..., 0] != IDLE)
        if clash.any():
            t, r = (int(x) for x in np.argwhere(clash)[0])
            raise ValueError(f"{s.name}: tick {t} rank {r} pairs two {kind}; the executor pairs a forward with a "
                             f"backward (B, W or BW)")
    return [np.where(fwd[0][..., :1] != IDLE, fwd[0], fwd[1]), np.where(bwd[0][..., :1] != IDLE, bwd[0], bwd[1])]


def _messages(s: Schedule, lanes, forward_only):
    """Every message of the schedule (its tables `lanes`: the table, and the paired actions' if any):
    key -> (producer rank, producer tick, consumer rank, last use tick).

    ("x", mb, stage) is the input activation of F(mb, stage); ("g", mb, stage) is the output cotangent of
    stage `stage`, read by its B / BW and again by its W."""
    p, num_stages = s.num_ranks, s.num_stages
    rank_of = {int(s.stage_of[r, c]): r for r in range(p) for c in range(s.num_chunks)}
    f_at, g_at, w_at = {}, {}, {}  # (mb, stage) -> tick of F / of B or BW / of W
    for table in lanes:
        for t, r in np.argwhere(table[..., 0] != IDLE):
            kind, mb, c, _ = (int(x) for x in table[t, r])
            key = (mb, int(s.stage_of[r, c]))
            {F: f_at, B: g_at, BW: g_at, W: w_at}[kind][key] = int(t)
    msgs = {}
    for (mb, stage), t in f_at.items():
        if stage + 1 < num_stages:
            key, use = ("x", mb, stage + 1), f_at.get((mb, stage + 1))
        elif forward_only:  # the loss stays on the last stage's rank
            continue
        else:  # the last stage's F also computes the loss: it seeds the backward locally
            key, use = ("g", mb, stage), g_at.get((mb, stage))
        msgs[key] = (rank_of[stage], t, rank_of[key[2]], use)
    for (mb, stage), t in g_at.items():
        if stage > 0:
            msgs[("g", mb, stage - 1)] = (rank_of[stage], t, rank_of[stage - 1], g_at.get((mb, stage - 1)))
    for key, (src, t, dst, use) in msgs.items():
        if key[0] == "g":
            use = max(use if use is not None else -1, w_at.get(key[1:], -1))
        if use is None or use <= t:
            raise ValueError(f"{s.name}: {key} is produced at tick {t} but used at tick {use}; run "
                             f"parallax.pipeline.validate.validate on the schedule and fix what it reports")
        if src != dst and dst not in ((src + 1) % p, (src - 1) % p):
            raise ValueError(f"{s.name}: stage {key[2]} on rank {dst} takes input from rank {src}, which is "
                             f"not a neighbour; place consecutive stages on neighbouring ranks")
        msgs[key] = (src, t, dst, use)
    return msgs


def _compile_steady(s: Schedule) -> Program:
    """A steady window's program. Its messages are those of the middle window of three run back to back
    (`unroll`); an action that reads a message sent in the window before reads the entry of the same
    message one step later (the windows repeat), and entries are coloured on the circle of the window."""
    m, n, p = s.num_microbatches, s.num_ticks, s.num_ranks
    full = unroll(s, 3)
    msgs = _messages(full, [full.table], False)
    mine = {k: v for k, v in msgs.items() if n <= v[1] < 2 * n}  # sent in the middle window
    entry = {}
    for dst in range(p):
        keys = [k for k, v in mine.items() if v[2] == dst]
        colours = circular_colouring([list(range(mine[k][1] + 1, mine[k][3] + 1)) for k in keys], n)
        entry.update(zip(keys, colours))
    inbox_size = max(entry.values(), default=-1) + 1

    class Periodic(dict):  # a message sent in the window before: the same message one step later
        def __getitem__(self, key):
            return dict.__getitem__(self, key if key in self else (key[0], key[1] + m, key[2]))
    middle = full.table.copy()
    middle[:n] = middle[2 * n:] = (IDLE, -1, -1, -1)
    code, up, down = _instructions(full, middle, msgs, Periodic(entry), False)
    code = code[n:2 * n]
    code[..., Field.VERSION] = np.where(code[..., Field.BRANCH] != Op.IDLE, code[..., Field.MB] >= m, 0)
    branches = tuple(sorted(set(code[..., Field.BRANCH].ravel().tolist()) | {Op.IDLE}))
    code[..., Field.BRANCH] = np.searchsorted(np.array(branches), code[..., Field.BRANCH])
    return Program(code, branches, inbox_size, s.num_slots, tuple(sorted(up)), tuple(sorted(down)), steady=True)


def _inbox_entries(msgs, p):
    """Inbox entry of each message on its consumer rank, and the inbox size: greedy interval colouring in
    arrival order (optimal for intervals). An entry freed by a read at tick u can take a message that
    arrives at the end of tick u."""
    entry = {}
    free_at = [[] for _ in range(p)]  # per rank: entry -> tick after which it is free
    for key, (src, t, dst, use) in sorted(msgs.items(), key=lambda kv: (kv[1][1], kv[0])):
        pool = free_at[dst]
        i = next((i for i, f in enumerate(pool) if f <= t), len(pool))
        if i == len(pool):
            pool.append(0)
        pool[i] = use
        entry[key] = i
    return entry, max(len(pool) for pool in free_at)


def _instructions(s: Schedule, table, msgs, entry, forward_only):
    """The int32 [ticks, p, fields] code (branch ids not yet compacted) and the ppermute pairs used."""
    p, num_stages = s.num_ranks, s.num_stages
    code = np.full((table.shape[0], p, NUM_FIELDS), -1, np.int32)
    code[..., Field.BRANCH] = Op.IDLE
    code[..., Field.MB:Field.SLOT + 1] = 0
    code[..., Field.VERSION] = 0
    up, down = set(), set()
    for t, r in np.argwhere(table[..., 0] != IDLE):
        kind, mb, c, slot = (int(x) for x in table[t, r])
        stage = int(s.stage_of[r, c])
        first, last = stage == 0, stage == num_stages - 1
        ins = code[t, r]
        ins[Field.MB], ins[Field.CHUNK], ins[Field.SLOT] = mb, c, slot
        if kind == F:
            ins[Field.BRANCH] = Op.F_FIRST if first else Op.F_LAST if last else Op.F
            if not first:
                ins[Field.IN] = entry["x", mb, stage]
            out = (None if forward_only else ("g", mb, stage)) if last else ("x", mb, stage + 1)
        else:
            ins[Field.BRANCH] = {B: (Op.B, Op.B_FIRST), W: (Op.W, Op.W), BW: (Op.BW, Op.BW_FIRST)}[kind][first]
            ins[Field.IN] = entry["g", mb, stage]
            out = ("g", mb, stage - 1) if kind != W and not first else None
        if out is None:
            continue
        src, _, dst, _ = msgs[out]
        if dst == src:
            ins[Field.LOCAL] = entry[out]
        elif dst == (src + 1) % p:
            code[t, dst, Field.FROM_UP] = entry[out]
            up.add((src, dst))
        else:
            code[t, dst, Field.FROM_DOWN] = entry[out]
            down.add((src, dst))
    return code, up, down
