"""Operating long runs: goodput accounting (`parallax.goodput`) and hang detection (`parallax.hang`).

The accounts and the hang rules are checked on a clock the test moves by hand (the expected seconds are
sums done here); a real run killed twice is in tests/test_checkpoint.py (its accounts against the wall time
measured from outside), a real hang on one process here and on two in tests/test_multiprocess.py.
"""

import json
import os
import time

import jax
import numpy as np
import pytest
from etils import epath

from helpers import ROOT, read_metrics, run_launcher, tiny_config
from parallax import goodput as goodput_lib
from parallax.errors import EXIT_HANG
from parallax.hang import FLOOR_S, MIN_STEPS, WINDOW, HangWatch
from parallax.train import train_and_evaluate


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _attempt(path, clock, start):
    return goodput_lib.Goodput(path, start=start, clock=clock)


def test_goodput_moves_the_steps_past_the_restored_checkpoint_to_lost_and_adds_up_over_attempts(tmp_path):
    path = epath.Path(tmp_path) / goodput_lib.FILE
    clock = Clock(1000.0)
    # Attempt 1: startup 2 s, a compiling step of 5 s, steps 2..7 of 1 s each, a save started after step 3
    # (0.5 s) and after step 6 (0.5 s); killed after step 7 with the save of 6 unfinished.
    g = _attempt(path, clock, start=1000.0)
    g.restored(0)
    g.add("startup", 2.0)
    g.step(1, 5.0, compiled=True)
    for step in range(2, 8):
        g.step(step, 1.0, compiled=False)
        if step in (3, 6):
            g.saving(step)
            g.add("checkpoint", 0.5)
    clock.t = 1000.0 + 2 + 5 + 6 + 1.0 + 0.5  # 0.5 s unaccounted: logging ('other')
    g.persist(force=True)
    saved = json.loads(path.read_text())
    assert saved["attempts"] == 1 and saved["wall_s"] == pytest.approx(14.5)
    assert saved["buckets"]["productive"] == pytest.approx(6.0) and saved["buckets"]["compile"] == 5.0
    assert saved["buckets"]["other"] == pytest.approx(0.5) and saved["buckets"]["lost"] == 0
    # Attempt 2 restores step 3 (the save of 6 never completed): steps 4..7 (4 s) were redone.
    clock.t = 2000.0
    g = _attempt(path, clock, start=2000.0)
    g.add("checkpoint", 1.0)  # the restore
    g.restored(3)
    g.add("startup", 2.0)
    g.step(4, 4.0, compiled=True)
    clock.t = 2007.0
    g.persist(force=True)
    b = json.loads(path.read_text())["buckets"]
    assert b["lost"] == pytest.approx(4.0) and b["productive"] == pytest.approx(2.0)  # steps 2 and 3
    assert b["compile"] == pytest.approx(9.0) and b["checkpoint"] == pytest.approx(2.0)
    assert g.attempts == 2 and g.wall() == pytest.approx(14.5 + 7.0) and sum(b.values()) == pytest.approx(21.5)
    # Attempt 3 restores 3 again: the compile of attempt 2 is lost as well; a completed save protects.
    clock.t = 3000.0
    g = _attempt(path, clock, start=3000.0)
    g.restored(3)
    for step in range(4, 7):
        g.step(step, 1.0, compiled=False)
    g.saving(6)
    g.step(7, 1.0, compiled=False)
    g.saving(7)  # the save of 6 is complete now: steps 4..6 can no longer be lost
    g.saved_all()
    clock.t = 3004.0
    g.persist(force=True)
    final = goodput_lib.read(tmp_path)
    assert final["attempts"] == 3 and final["pending"] == [[7, {}]]
    assert final["buckets"]["lost"] == pytest.approx(8.0) and final["buckets"]["compile"] == pytest.approx(5.0)
    assert final["buckets"]["productive"] == pytest.approx(2.0 + 4.0)
    assert final["wall_s"] == pytest.approx(14.5 + 7.0 + 4.0) == pytest.approx(sum(final["buckets"].values()))
    assert g.metrics()["goodput"] == pytest.approx(6.0 / 25.5)
    assert g.line().startswith("goodput 23.5% of 25.5s over 3 attempts: productive 6.0s, compile 5.0s")


def test_a_rewind_moves_the_thrown_away_steps_of_this_attempt_and_of_earlier_ones_to_lost(tmp_path):
    path = epath.Path(tmp_path) / goodput_lib.FILE
    clock = Clock(0.0)
    g = _attempt(path, clock, start=0.0)
    g.restored(0)
    for step in range(1, 5):
        g.step(step, 1.0, compiled=False)
    g.saving(4)
    g.step(5, 2.0, compiled=False)
    clock.t = 10.0
    g.persist(force=True)  # killed here: step 5 (2 s) not under a complete checkpoint
    clock.t = 100.0
    g = _attempt(path, clock, start=100.0)
    g.restored(4)  # the save of 4 had completed: only step 5 is lost
    assert g.before["lost"] == 2.0 and g.before["productive"] == 4.0
    g.step(5, 1.0, compiled=True)
    g.step(6, 1.0, compiled=False)
    g.step(7, 1.0, compiled=False)
    g.rewound(4, 7)  # back to the checkpoint of 4 at step 7: steps 5-7 of this attempt thrown away
    assert g.now["lost"] == 3.0 and g.now["compile"] == 0.0 and g.now["productive"] == 0.0
    assert g.before["lost"] == 2.0 and g.pending == [[7, {}, False]]
    g.step(8, 1.0, compiled=False)
    assert g.pending == [[7, {"productive": 1.0}, False]]
    clock.t = 110.0
    b = g.buckets()
    assert (b["lost"], b["productive"], b["other"]) == (5.0, 5.0, 4.0 + 6.0) and g.wall() == 20.0


def test_process_start_time_is_when_the_process_started(tmp_path):
    """Read in a child process started here: between the moment before it was started and the moment it
    printed (clock ticks: 10 ms on Linux)."""
    import subprocess
    import sys

    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0); "  # imported late: not its import time
                          "from parallax.goodput import process_start_time; print(process_start_time(), time.time())"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    started, printed = float(out[0]), float(out[1])
    assert before - 0.05 <= started <= printed - 1.0 and started - before < 0.5, (before, started, printed)


def test_goodput_writes_at_most_every_persist_interval_and_process_start_is_before_now(tmp_path):
    path = epath.Path(tmp_path) / goodput_lib.FILE
    clock = Clock(50.0)
    g = _attempt(path, clock, start=50.0)
    g.persist()
    assert path.exists()
    path.unlink()
    clock.t += goodput_lib.PERSIST_EVERY_S / 2
    g.persist()
    assert not path.exists()
    clock.t += goodput_lib.PERSIST_EVERY_S
    g.persist()
    assert path.exists()
    assert 0 < time.time() - goodput_lib.process_start_time() < 24 * 3600


def test_hang_rules_on_a_moved_clock():
    clock = Clock(0.0)
    fired = []
    watch = HangWatch(None, timeout_s=10, factor=0, clock=clock, on_hang=fired.append)
    watch.running(1, timed=False)
    clock.t = 10.0
    assert watch.check(clock()) is None  # not over the timeout yet
    clock.t = 10.5
    assert watch.check(clock()).startswith("nothing finished for 10.5 s (train.hang_timeout_s=10), step 1")
    with watch.paused():  # e.g. a compile
        clock.t = 100.0
        assert watch.check(clock()) is None
    assert watch.check(clock()) is None  # leaving the pause counts as progress
    watch.finished()
    clock.t = 111.0
    assert watch.check(clock()) == "nothing finished for 11.0 s (train.hang_timeout_s=10), between steps"
    # The median rule: steps of 1 s; a step is hung past max(factor x median, FLOOR_S).
    watch = HangWatch(None, timeout_s=0, factor=3, clock=clock)
    for step in range(1, MIN_STEPS + 1):
        watch.running(step)
        assert watch.check(clock.t + 1000) is None  # fewer than MIN_STEPS timed steps so far
        clock.t += 1.0
        watch.finished()
        clock.t += 1.0  # between steps: the median rule does not apply
    assert watch.times == [1.0] * MIN_STEPS
    watch.running(MIN_STEPS + 1)
    assert watch.check(clock.t + FLOOR_S - 0.1) is None  # over 3 x median but under the floor
    assert "over train.hang_factor=3 x the median step 1.000 s" in watch.check(clock.t + FLOOR_S + 0.1)
    watch = HangWatch(None, factor=3, clock=clock)
    for step in range(WINDOW + 5):
        watch.running(step, timed=step != 0)
        clock.t += 10.0 if step == 0 else 4.0
        watch.finished()
    assert watch.times == [4.0] * WINDOW  # the compiling step left out, the window kept
    watch.running(99)
    assert watch.check(clock.t + 12.0) is None and watch.check(clock.t + 12.1) is not None


def test_hang_messages_and_the_rules_edges():
    clock = Clock(500.0)
    watch = HangWatch(None, timeout_s=0.5, clock=clock)  # under a second is a timeout too
    clock.t = 501.0
    assert watch.check(clock()) == "nothing finished for 1.0 s (train.hang_timeout_s=0.5), between steps"
    off = HangWatch(None, timeout_s=0, factor=0, clock=clock)  # both rules off: never
    for step in range(MIN_STEPS + 2):
        off.running(step)
        clock.t += 1.0
        off.finished()
    off.running(99)
    assert off.check(clock.t + 1e6) is None
    low = HangWatch(None, factor=1.5, clock=clock)  # any multiple over 1 is valid
    for step in range(MIN_STEPS):
        low.running(step)
        clock.t += 10.0
        low.finished()
    low.running(7)
    assert low.check(clock.t + 14.9) is None
    assert low.check(clock.t + 15.1) == "step 7 has run 15.1 s, over train.hang_factor=1.5 x the median step 10.000 s"


def test_the_watching_thread_reports_once_and_the_dump_holds_every_threads_stack(tmp_path):
    import threading

    fired = []
    watch = HangWatch(tmp_path / "hang", timeout_s=0.2, process=3, on_hang=fired.append).start()
    deadline = time.time() + 30
    while not fired and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # it reports once, then stops watching
    assert len(fired) == 1 and fired[0].startswith("nothing finished for 0.") and fired[0].endswith(
        "s (train.hang_timeout_s=0.2), between steps"), fired
    stuck = threading.Event()
    helper = threading.Thread(target=stuck.wait, name="a-stuck-helper", daemon=True)
    helper.start()
    watch.dump("an earlier reason")
    where = watch.dump("a reason")  # the directory exists now: written again
    stuck.set()
    assert where == str(tmp_path / "hang" / "process_3.txt")
    text = open(where).read()
    assert text.startswith("parallax hang on process 3: a reason\n\n") and "Current thread" in text
    assert text.count("\nThread 0x") >= 1 and "in wait" in text  # the other threads' stacks too
    HangWatch(None).start().stop()  # both rules off: no thread


def test_a_dump_that_cannot_be_written_goes_to_stderr(tmp_path, capfd):
    (tmp_path / "a_file").write_text("")
    watch = HangWatch(tmp_path / "a_file" / "hang", timeout_s=1)
    assert watch.dump("why") == "stderr"
    err = capfd.readouterr().err
    assert "Current thread" in err and "test_a_dump_that_cannot_be_written_goes_to_stderr" in err


def test_fewer_than_min_steps_never_trip_the_median_rule():
    clock = Clock(0.0)
    watch = HangWatch(None, factor=2, clock=clock)
    for step in range(MIN_STEPS - 1):
        watch.running(step)
        clock.t += 1.0
        watch.finished()
    watch.running(MIN_STEPS)
    assert watch.check(clock.t + 1e6) is None


@pytest.mark.slow
def test_a_step_that_hangs_dumps_every_threads_stack_and_exits_with_the_hang_status(tmp_path):
    """One process sleeps inside its 6th step (tests/hang_model.py): within train.hang_timeout_s (+ a check
    interval) of the last finished step it writes its threads' stacks, the sleeping callback's among them, and
    exits 4 with one line; the compile of the first step (longer than the timeout here) does not count."""
    workdir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests"), "JAX_PLATFORMS": "cpu",
           "PARALLAX_TEST_HANG_AT": "6"}
    run = run_launcher("train", f"--config={ROOT}/tests/hang_model.py", f"--workdir={workdir}", "--cpu_devices=2",
                       "--config.mesh.data=2", "--config.train.hang_timeout_s=2", "--config.train.log_every=1",
                       env=env, timeout=300)
    assert run.returncode == EXIT_HANG, run.stderr[-3000:]
    dump = (workdir / "hang" / "process_0.txt").read_text()
    assert dump.startswith("parallax hang on process 0: nothing finished for 2.") and ", step 6\n" in dump, dump
    assert 'hang_model.py", line' in dump and "in _maybe_hang" in dump  # the stuck thread's frame
    assert run.stderr.strip().splitlines()[-1].startswith(
        "hang: nothing finished for 2.") and f"{workdir}/hang/process_0.txt; exit 4" in run.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]


SPIKE_STEPS = (14, 15)  # the planted batches; checkpoints every 4 steps: the rewind goes back to step 12
SKIPPED = 3  # steps 13-15's batches
RARE = 58  # the rarest target of the tiny config's first batches (115 of 10240)
def _one():
    """One device: the policy is the loop's and the update's, the same on any mesh. A function, not a module
    constant: importing this file must not start JAX's runtime (make mutation forks after collecting it)."""
    return jax.devices()[:1]


def _spike_config(steps, policy="skip"):
    config = tiny_config()
    config.train.update(steps=steps, log_every=1, eval_every=0, checkpoint_every=4, keep_checkpoints=3,
                        spike_policy=policy, spike_window=8, spike_zscore=6.0, spike_rewind_after=2)
    config.optim.update(lr=1e-2, warmup_steps=0, decay_steps=24)  # learns in 12 steps; one LR schedule for all
    return config


def _planted(monkeypatch, kinds=None, shift=0):
    """Batches as the run's dataset makes them, except at the steps of `kinds` ({step: 'garbage' (every target
    the same rare token) or 'nan' (NaN loss weights)}); `shift`: the batches of steps after 12 are those of
    `shift` steps later (the reference of a run that skipped them)."""
    kinds = kinds or {}
    from parallax import train as train_lib

    make = train_lib.make_dataset

    class Planted:
        def __init__(self, dataset, vocab_size):
            self.dataset, self.vocab_size = dataset, vocab_size

        def __getattr__(self, name):
            return getattr(self.dataset, name)

        def batch(self, index, split="train", **kwargs):  # batch `index` feeds step index + 1
            if split == "train" and index >= 12:
                index += shift
            out = dict(self.dataset.batch(index, split, **kwargs))
            kind = kinds.get(index + 1) if split == "train" else None
            if kind == "garbage":
                out["targets"] = np.full_like(out["targets"], RARE)
            elif kind == "nan":
                out["weights"] = np.full_like(out["weights"], np.nan)
            return out
    monkeypatch.setattr(train_lib, "make_dataset", lambda config, tokenizer=None: Planted(
        make(config, tokenizer), config.model.vocab_size))


@pytest.fixture(scope="module")
def spike_reference(tmp_path_factory):
    """The run a spike-and-rewind run must equal: no policy, 21 steps, the batches of steps 13-15 left out
    (its step k > 12 trains on the batch of step k + 3), by the plain loop."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _planted(monkeypatch, shift=SKIPPED)
        result = train_and_evaluate(_spike_config(24 - SKIPPED, "off"), str(tmp_path_factory.mktemp("ref")),
                                    devices=_one(), log=lambda *_: None)
    assert "spike" not in result.state  # off: the state as before the policy existed
    return [r["loss"] for r in result.history]


@pytest.mark.slow
def test_planted_spikes_are_skipped_then_rewound_past_and_the_run_equals_one_that_never_saw_them(
        spike_reference, tmp_path, monkeypatch):
    """A garbage batch at step 14 (every target one rare token) and a NaN one at step 15 (with
    nan_policy=stop, which the spike policy overrides): both are spikes (skipped), the second in a row rewinds
    to the checkpoint of step 12 and steps 13-15's batches are skipped. The run stops at step 15, right after
    the rewind (its checkpoint holds the rewound state), and the rerun of the same command continues to step
    24: every step equals, fp32 1e-5, the reference that never trained on those batches, and the skips and
    the rewind are in metrics.jsonl (strict JSON: the NaN step has no loss)."""
    _planted(monkeypatch, {14: "garbage", 15: "nan"})
    workdir = str(tmp_path / "run")
    lines = []
    first = train_and_evaluate(_spike_config(15), workdir, devices=_one(), log=lines.append)
    assert [line for line in lines if "rewound" in line] == [
        "step 15: 2 spikes in a row: rewound the parameters and optimizer state to the checkpoint of step 12; the "
        "batches of steps 13-15 are skipped"]
    assert int(first.state["step"]) == 15
    train_and_evaluate(_spike_config(24), workdir, devices=_one(), log=lambda *_: None)
    records = {r["step"]: r for r in read_metrics(workdir)}
    assert sorted(records) == list(range(1, 25))
    assert sorted(s for s, r in records.items() if r.get("spike_skipped")) == list(SPIKE_STEPS)
    assert records[15]["rewound_to"] == 12 and "rewound_to" not in records[14]
    assert records[14]["grad_norm"] > 2 * records[13]["grad_norm"]  # what the garbage batch does
    assert records[15]["non_finite"] == 1 and "loss" not in records[15]
    losses = [records[s]["loss"] for s in range(1, 25) if s not in range(13, 16)]
    np.testing.assert_allclose(losses, spike_reference, rtol=1e-5)


@pytest.mark.parametrize("key,value,message", [
    ("spike_policy", "rewind", "config.train.spike_policy='rewind': expected off or skip"),
    ("spike_zscore", 0.0, r"config.train.spike_zscore=0.0: must be > 0"),
    ("spike_window", 1, r"config.train.spike_window=1: must be >= 2"),
    ("spike_rewind_after", -1, r"config.train.spike_rewind_after=-1: must be >= 0 \(0: never rewind\)"),
    ("hang_timeout_s", -1.0, r"config.train.hang_timeout_s=-1.0: must be >= 0 \(0 turns it off\)"),
    ("hang_factor", 1.0, r"config.train.hang_factor=1.0: a multiple of the median step, so over 1"),
    ("local_checkpoint_every", -1, r"config.train.local_checkpoint_every=-1: must be >= 0 \(0 turns it off\)"),
    ("local_checkpoint_keep", 1, r"config.train.local_checkpoint_keep=1: must be >= 2 \(a process killed"),
])
def test_bad_spike_hang_and_local_tier_settings_are_one_line_naming_the_key(key, value, message):
    from parallax import train_settings
    from parallax.errors import ConfigError

    config = tiny_config()
    config.train[key] = value
    with pytest.raises(ConfigError, match=message):
        train_settings.resolve(config.train)


def test_the_spike_policy_is_refused_where_the_step_applies_other_gradients_than_the_batchs():
    from parallax.errors import ConfigError
    from parallax.trainer import shape_check

    config = tiny_config(pipe=2, data=4)
    config.model.num_layers = 4
    config.pipeline.update(schedule="2bw", microbatches=4)
    shape_check(config, 8)  # trains without the policy
    config.train.spike_policy = "skip"
    with pytest.raises(ConfigError, match=r"config.train.spike_policy='skip': SteadyPipelinePath's step applies "
                                          r"other gradients .*; set spike_policy=off"):
        shape_check(config, 8)


def test_a_rewind_requested_by_file_goes_back_to_the_checkpoint_and_skips_the_batches_since(
        spike_reference, tmp_path):
    """An operator writes `WORKDIR/REWIND` with step 12 while step 15 runs (no spike policy): after it the run
    restores the newest checkpoint at or before 12 (step 12 itself), keeps the step count, and from step 16 on equals,
    bitwise, the reference that never trained on the batches of steps 13-15; the file is renamed
    REWIND.done. A file that names no step is one line and renamed REWIND.rejected."""
    workdir = tmp_path / "run"
    lines = []

    def log(line):
        lines.append(line)
        if "step 15/" in line:
            (workdir / "REWIND").write_text("12\n")  # a checkpoint's own step: at or before it is itself
        if "step 18/" in line:
            (workdir / "REWIND").write_text("soon")
    train_and_evaluate(_spike_config(24, "off"), str(workdir), devices=_one(), log=log)
    assert [line for line in lines if "rewound" in line] == [
        f"step 15: a rewind requested in {workdir}/REWIND: rewound the parameters and optimizer state to the "
        "checkpoint of step 12; the batches of steps 13-15 are skipped"]
    assert f"{workdir}/REWIND: 'soon' is not a step; write a step number (the newest checkpoint at or before it) " \
           "or nothing (the newest checkpoint); ignored" in lines
    assert (workdir / "REWIND.done").read_text() == "12\n" and (workdir / "REWIND.rejected").exists()
    assert not (workdir / "REWIND").exists()
    records = {r["step"]: r for r in read_metrics(workdir)}
    losses = [records[s]["loss"] for s in range(1, 25) if s not in range(13, 16)]
    assert losses == spike_reference  # bitwise: no spike statistics here, the same program as the reference's
