"""The schedule validator, rule by rule: for every dependency rule and every schedule family (plain fused
1F1B, plain split ZB-H1, interleaved, V-shaped ZB-V), a table that breaks only that rule is rejected with
that rule's message; and property tests over random (schedule, p, m, v): every generated table validates,
and the simulator's async bubble never beats the (p-1) / (units per rank + p-1) floor. No jax needed."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallax.pipeline.schedule import B, BW, F, IDLE, SCHEDULES, W, ScheduleError, make_schedule
from parallax.pipeline.validate import validate
from parallax.pipeline.simulate import simulate

P_, M_ = 4, 8
FAMILIES = {"plain-fused": ("1f1b", 1), "plain-split": ("zb_h1", 1), "interleaved": ("interleaved_1f1b", 2),
            "v-shaped": ("zbv", 2)}


def _schedule(family):
    name, v = FAMILIES[family]
    return make_schedule(name, P_, M_, v)


def _backward(s):
    return B if s.split_backward else BW


def _at(s, kind, mb, stage):
    """(tick, rank) of action `kind` of microbatch `mb` on `stage`."""
    r, c = s.rank_of_stage(stage)
    rows = (s.table[:, r, 0] == kind) & (s.table[:, r, 1] == mb) & (s.table[:, r, 2] == c)
    return int(np.argwhere(rows)[0, 0]), r


def _swap(table, r, t1, t2):
    table[[t1, t2], r] = table[[t2, t1], r]


def _idle_after(s, r, t):
    ticks = [int(x) for x in np.argwhere(s.table[:, r, 0] == IDLE)[:, 0] if x > t]
    assert ticks, f"rank {r} has no idle tick after {t}"
    return ticks[0]


# Each rule: (applies to split / fused families, edit(schedule, table), the message it must give).
def _input_activation(s, t):  # F of stage 1 at the tick of its input's F (tick 0, an idle one for stage 1)
    t0, _ = _at(s, F, 0, 0)
    t1, r = _at(s, F, 0, 1)
    _swap(t, r, t1, t0)
    return r"F\(mb=0, chunk=\d\) runs before its input activation from stage 0 \(F at tick 0\); move it"


def _never_runs(s, t):  # the input of F(mb=1) on stage 1 is dropped
    t0, r = _at(s, F, 1, 0)
    t[t0, r] = (IDLE, -1, -1, -1)
    return r"F\(mb=1, chunk=\d\) needs its input activation from stage 0 \(F\(mb=1\) of stage 0\), which never runs"


def _own_forward(s, t):  # the last stage's backward at the tick of its own forward
    last = s.num_stages - 1
    tf, _ = _at(s, F, 0, last)
    tb, r = _at(s, _backward(s), 0, last)
    _swap(t, r, tb, tf)
    return rf"\(mb=0, chunk=\d\) runs before its own forward on stage {last}"


def _input_gradient(s, t):  # stage L-2's backward at the tick of stage L-1's
    last = s.num_stages - 1
    tg, _ = _at(s, _backward(s), 0, last)
    tb, r = _at(s, _backward(s), 0, last - 1)
    _swap(t, r, tb, tg)
    return rf"runs before its input gradient from stage {last}"


def _its_b(s, t):  # W before its B (split families)
    tb, r = _at(s, B, 0, 0)
    tw, _ = _at(s, W, 0, 0)
    _swap(t, r, tb, tw)
    return r"W\(mb=0, chunk=\d\) runs before its B on stage 0"


def _live_slot(s, t):  # F(mb=1) of stage 0 stores into mb 0's slot, still live
    t0, r = _at(s, F, 0, 0)
    t1, _ = _at(s, F, 1, 0)
    t[t1, r, 3] = t[t0, r, 3]
    return rf"F\(mb=1, chunk=\d\) stores into slot {t[t0, r, 3]}, still live for mb=0 of stage 0"


def _slot_mismatch(s, t):
    tb, r = _at(s, _backward(s), 0, 0)
    t[tb, r, 3] = 99
    return r"reads slot 99, but its activation is in slot"


def _runs_twice(s, t):
    tf, r = _at(s, F, 0, 0)
    t[_idle_after(s, r, tf), r] = t[tf, r]
    return r"F\(mb=0, chunk=\d\) of stage 0 runs twice"


def _b_and_bw(s, t):  # split: a B becomes BW (its W then also conflicts); fused: a W added after a BW
    if s.split_backward:
        tb, r = _at(s, B, 0, 0)
        t[tb, r, 0] = BW
        return r"runs both B and BW|already runs BW"
    tb, r = _at(s, BW, 0, 0)
    t[_idle_after(s, r, tb), r] = (W, *t[tb, r, 1:])
    return r"W\(mb=0, chunk=\d\): stage 0 already runs BW"


def _complete(s, t):  # the very last backward piece of stage 0 dropped: nothing later depends on it
    kind = W if s.split_backward else BW
    tw, r = _at(s, kind, M_ - 1, 0)
    t[tw, r] = (IDLE, -1, -1, -1)
    missing = "W" if s.split_backward else r"backward \(BW, or B \+ W\)"
    return rf"mb={M_ - 1} stage 0 \(rank 0 chunk 0\) has no {missing}; add it"


def _no_f(s, t):  # every action of the last microbatch dropped: its first missing piece is stage 0's F
    t[t[..., 1] == M_ - 1] = (IDLE, -1, -1, -1)
    return rf"mb={M_ - 1} stage 0 \(rank 0 chunk 0\) has no F; add it"


RULES = {"input-activation": _input_activation, "never-runs": _never_runs, "own-forward": _own_forward,
         "input-gradient": _input_gradient, "w-after-b": _its_b, "live-slot": _live_slot,
         "slot-mismatch": _slot_mismatch, "runs-twice": _runs_twice, "b-and-bw": _b_and_bw,
         "complete": _complete, "complete-f": _no_f}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_table_breaking_one_rule_is_rejected_with_its_message(family, rule):
    s = _schedule(family)
    if rule == "w-after-b" and not s.split_backward:
        pytest.skip("fused schedules have no W")
    validate(s)
    table = s.table.copy()
    pattern = RULES[rule](s, table)
    assert not np.array_equal(table, s.table)
    with pytest.raises(ScheduleError, match=pattern) as e:
        validate(dataclasses.replace(s, table=table))
    assert "\n" not in str(e.value)


def _valid_cases():
    @st.composite
    def case(draw):
        name = draw(st.sampled_from(list(SCHEDULES)))
        p = draw(st.integers(1, 8))
        m = draw(st.integers(1, 16))
        v = draw(st.integers(2, 4)) if name == "interleaved_1f1b" else 2 if name == "zbv" else 1
        assume(name != "interleaved_1f1b" or m % p == 0)
        assume(name != "dualpipev" or m >= 2 * p)
        return name, p, m, v
    return case()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_valid_cases())
def test_every_generated_schedule_validates_and_no_bubble_beats_the_floor(case):
    name, p, m, v = case
    s = make_schedule(name, p, m, v)
    validate(s)
    sim = simulate(s, mode="async")
    units = sim.busy_time / p  # unit-cost actions per rank (F = B = W = 1, BW = 2)
    assert sim.bubble >= (p - 1) / (units + p - 1) - 1e-12, (name, p, m, v, sim.bubble)


# ---- malformed input: a hand-built Schedule with a wrong shape, dtype, placement or cell is rejected with
# the whole message, which names what was expected and what it got (the user reads it, not a traceback).

def _tiny():  # 1f1b, 2 ranks, 2 microbatches; tick 0: F(mb=0) on rank 0, rank 1 idle
    return make_schedule("1f1b", 2, 2)


def _message(s):
    with pytest.raises(ScheduleError) as e:
        validate(s)
    return str(e.value)


@pytest.mark.parametrize("changes, message", [
    ({"num_ranks": 0}, "need num_ranks, num_microbatches, num_chunks >= 1, got 0, 2, 1"),
    ({"num_microbatches": 0}, "need num_ranks, num_microbatches, num_chunks >= 1, got 2, 0, 1"),
    ({"num_chunks": 0}, "need num_ranks, num_microbatches, num_chunks >= 1, got 2, 2, 0"),
    ({"table": [[[0, -1, -1, -1]] * 2]}, "table must be int32 [ticks, 2, 4], got <class 'list'> "),
    ({"table": np.zeros((6, 2, 4), np.int64)}, "table must be int32 [ticks, 2, 4], got int64 (6, 2, 4)"),
    ({"table": np.zeros((6, 2), np.int32)}, "table must be int32 [ticks, 2, 4], got int32 (6, 2)"),
    ({"table": np.zeros((6, 3, 4), np.int32)}, "table must be int32 [ticks, 2, 4], got int32 (6, 3, 4)"),
    ({"table": np.zeros((6, 2, 3), np.int32)}, "table must be int32 [ticks, 2, 4], got int32 (6, 2, 3)"),
    ({"stage_of": [[0], [1]]}, "stage_of must be int32 [2, 1], got <class 'list'> "),
    ({"stage_of": np.array([[0], [1]])}, "stage_of must be int32 [2, 1], got int64 (2, 1)"),
    ({"stage_of": np.array([[0, 1]], np.int32)}, "stage_of must be int32 [2, 1], got int32 (1, 2)"),
    ({"stage_of": np.array([[1], [2]], np.int32)},
     "stage_of must hold each stage 0..1 exactly once, got [[1], [2]]"),
])
def test_malformed_schedule_structure_is_rejected_with_the_expected_shape(changes, message):
    assert _message(dataclasses.replace(_tiny(), **changes)) == message


@pytest.mark.parametrize("cell, message", [
    ((IDLE, 0, -1, -1), "idle cell must be (0, -1, -1, -1), got (0, 0, -1, -1)"),
    ((IDLE, -1, 0, -1), "idle cell must be (0, -1, -1, -1), got (0, -1, 0, -1)"),
    ((IDLE, -1, -1, 0), "idle cell must be (0, -1, -1, -1), got (0, -1, -1, 0)"),
    ((-1, 0, 0, 0), "unknown action kind -1; use IDLE, F, B, W or BW (0..4)"),
    ((BW + 1, 0, 0, 0), "unknown action kind 5; use IDLE, F, B, W or BW (0..4)"),
    ((F, -1, 0, 0), "microbatch -1 out of range 0..1"),
    ((F, 2, 0, 0), "microbatch 2 out of range 0..1"),
    ((F, 0, -1, 0), "chunk -1 out of range 0..0; chunks are local to the rank that owns the stage"),
    ((F, 0, 1, 0), "chunk 1 out of range 0..0; chunks are local to the rank that owns the stage"),
    ((F, 0, 0, -1), "F(mb=0, chunk=0) has slot -1; slots are >= 0"),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_malformed_cell_is_rejected_naming_tick_rank_and_the_valid_range(cell, message, rank):
    s = _tiny()
    table = s.table.copy()
    table[0, rank] = cell  # tick 0: the first cell the validator reads on that rank
    assert _message(dataclasses.replace(s, table=table)) == f"tick 0 rank {rank}: {message}"


# 1f1b(2, 2), ticks 0..5:  rank 0: F0 F1 .  X0 .  X1   (slots 0 1 - 0 - 1)
#                          rank 1: .  F0 X0 F1 X1 .    (slots - 0 0 0 0 -)
@pytest.mark.parametrize("cells, message", [
    ({(0, 0): (IDLE, -1, -1, -1)}, "tick 1 rank 1: F(mb=0, chunk=0) needs its input activation from stage 0 "
                                   "(F(mb=0) of stage 0), which never runs; add it before tick 1"),
    ({(1, 1): (BW, 0, 0, 0), (2, 1): (F, 0, 0, 0)},
     "tick 1 rank 1: BW(mb=0, chunk=0) runs before its own forward on stage 1 (F at tick 2); move it to "
     "tick >= 3"),
    ({(4, 1): (IDLE, -1, -1, -1)}, "tick 5 rank 0: BW(mb=1, chunk=0) needs its input gradient from stage 1 "
                                   "(B(mb=1) of stage 1), which never runs; add it before tick 5"),
    ({(5, 1): (B, 0, 0, 0)}, "tick 2 rank 1: BW(mb=0, chunk=0): stage 1 runs both B and BW for this "
                             "microbatch; use B + W or one BW"),
    ({(5, 1): (W, 0, 0, 0)}, "tick 5 rank 1: W(mb=0, chunk=0): stage 1 already runs BW for this microbatch; "
                             "drop the W or split the BW into B"),
    ({(2, 1): (BW, 0, 0, 99)}, "tick 2 rank 1: BW(mb=0, chunk=0) reads slot 99, but its activation is in "
                               "slot 0 (or already freed); use the F's slot"),
    ({(1, 0): (F, 1, 0, 0)}, "tick 1 rank 0: F(mb=1, chunk=0) stores into slot 0, still live for mb=0 of "
                             "stage 0; use a free slot"),
    ({(5, 1): (F, 1, 0, 1)}, "tick 5 rank 1: F(mb=1, chunk=0) of stage 1 runs twice (first at tick 3); "
                             "remove one"),
])
def test_dependency_errors_give_the_whole_message(cells, message):
    s = _tiny()
    table = s.table.copy()
    for (t, r), cell in cells.items():
        table[t, r] = cell
    assert _message(dataclasses.replace(s, table=table)) == message
