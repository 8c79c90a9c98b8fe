"""A generated sweep over the config space (issue 48): a hypothesis strategy draws a configuration for 8
simulated devices on tiny shapes, and `check` holds it to one of two outcomes:

- refused: `make_plan` (or the trainer) raises a ConfigError whose message is one line; or
- it trains 2 steps, evaluates, checkpoints, and a rerun resumes the checkpoint bitwise; and where the
  numbers must equal one device's (fp32, no DiLoCo, a flushing schedule), the first batch's loss and every
  gradient leaf and the 2 step losses match the 1-device run of the same model config to 1e-5 relative
  (2bw: its second step's loss is the 1-device run's first with `optim.grad_delay=1`). bfloat16 and DiLoCo
  runs are held to finite losses and an exact resume only.

The 1-device reference is cached per distinct model / optimizer config (`reference_key`), so many layouts
share one compiled reference.

    python tests/sweep.py --examples=200 --seed=S          # the long run: one line per case, a summary
    python tests/sweep.py --config=configs/tiny.py --config.mesh.pipe=2 ...   # one case (a failure's line)

`tests/test_sweep.py` runs a few examples of a fixed seed in CI. Run it from the checkout root; it sets the
same XLA flags as tests/conftest.py (8 simulated CPU devices, cheap machine code).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # the suite's environment (XLA flags, compilation cache) before jax is imported
    sys.path.insert(0, HERE)
    import conftest  # noqa: F401

import jax  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from parallax.config import apply_override  # noqa: E402
from parallax.defaults import load_config_file  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402
from parallax.pipeline.schedule import KINDS, names  # noqa: E402
from parallax.plan import make_plan  # noqa: E402

ROOT = os.path.dirname(HERE)
DEVICES = 8
TOL = 1e-5
FILES = {"llama": "configs/tiny.py", "gpt2": "configs/gpt2_tiny.py", "moe": "configs/moe_tiny.py"}
# What every example sets: 2 steps, an eval and a checkpoint at step 2, a learning rate that moves at step 1.
FIXED = (("train.steps", 2), ("train.eval_every", 2), ("train.checkpoint_every", 2), ("train.log_every", 1),
         ("train.eval_batches", 1), ("optim.warmup_steps", 0), ("optim.lr", 0.01))
MESH_AXES = ("pipe", "tensor", "seq", "expert", "fsdp", "replica")


@dataclasses.dataclass(frozen=True)
class Case:
    """A drawn configuration: a config file and `--config.KEY=VALUE` overrides (launch/train.py's flags)."""
    family: str
    overrides: tuple  # ((key, value), ...) drawn, in draw order

    @property
    def file(self) -> str:
        return FILES[self.family]

    def flags(self, fixed=True) -> list[str]:
        return [f"--config.{k}={_text(v)}" for k, v in (*(FIXED if fixed else ()), *self.overrides)]

    def describe(self) -> str:
        return " ".join([f"--config={self.file}", *self.flags(fixed=False)])

    def command(self) -> str:
        """The command that checks this case alone."""
        return " ".join(["python tests/sweep.py", f"--config={self.file}", *self.flags(fixed=False)])

    def config(self):
        config = load_config_file(os.path.join(ROOT, self.file))
        for key, value in (*FIXED, *self.overrides):
            apply_override(config, key, _text(value))
        return config


def _text(value) -> str:
    return str(value)


def _rare(draw, n) -> bool:
    """True about once in `n` draws (not on hypothesis's favourite, the smallest value)."""
    return draw(st.integers(0, n - 1)) == 1


def _pick(draw, options, *weights):
    """One of `options`, drawn with integer `weights` (equal by default)."""
    pool = [o for o, w in zip(options, weights or [1] * len(options)) for _ in range(w)]
    return draw(st.sampled_from(pool))


@st.composite
def cases(draw) -> Case:
    """A configuration over 8 devices, steered toward ones the plan accepts (about 1 draw in 10 takes any
    mesh sizes, and a few values are drawn outside what their schedule or model takes), so that refusals
    are checked too without crowding out the runs."""
    family = _pick(draw, ("llama", "gpt2", "moe"), 2, 1, 2)
    o = {}
    sizes = {a: 1 for a in MESH_AXES}
    wild = _rare(draw, 10)
    if wild:  # any sizes: products past 8 or not dividing it are the plan's to refuse
        for axis in MESH_AXES:
            sizes[axis] = _pick(draw, (1, 2, 3, 4), 4, 2, 1, 1)
    else:
        left = DEVICES
        for axis in draw(st.permutations(MESH_AXES)):
            weights = {"pipe": (3, 3, 1), "tensor": (3, 2, 1 if family == "gpt2" else 0), "seq": (3, 2, 1),
                       "expert": (3, 2, 1) if family == "moe" else (6, 1, 0), "fsdp": (3, 2, 0),
                       "replica": (7, 1, 0)}[axis]
            options = [(d, w) for d, w in zip((1, 2, 4), weights) if left % d == 0 and w]
            sizes[axis] = _pick(draw, [d for d, _ in options], *[w for _, w in options])
            left //= sizes[axis]
    for axis in MESH_AXES:
        if sizes[axis] != 1:
            o[f"mesh.{axis}"] = sizes[axis]
    used = math.prod(sizes.values())
    data = DEVICES // used if DEVICES % used == 0 else 1
    if wild or _rare(draw, 20):  # data named explicitly (-1: what the others leave)
        o["mesh.data"] = _pick(draw, (-1, data, 2 * data))
    dp = data * sizes["fsdp"] * sizes["expert"] * sizes["replica"]  # rows split this many ways
    pipe = sizes["pipe"]

    # the layers: a multiple of the pipeline's stages, mostly
    stages = 1
    if pipe > 1:
        schedule = draw(st.sampled_from(names()))
        kind = KINDS[schedule]
        virtual = kind.chunks if kind.chunks is not None else _pick(draw, (1, 2), 1, 2)
        if _rare(draw, 20):
            virtual = _pick(draw, (1, 2, 3))
        o["pipeline.schedule"] = schedule
        if virtual != 1:
            o["pipeline.virtual_stages"] = virtual
        per_rank = max(1, 16 // dp)  # a row per data shard at least
        fits = [m for m in (1, 2, 4, 8, 16) if m <= per_rank and per_rank % m == 0]
        enough = [m for m in fits if m >= kind.min_microbatches(pipe) and (not kind.ranks_divide_microbatches
                                                                             or m % pipe == 0)]
        o["pipeline.microbatches"] = draw(st.sampled_from(enough if enough and not _rare(draw, 10) else fits))
        stages = pipe * virtual
        if draw(st.booleans()):
            o["pipeline.remat"] = True
        if _rare(draw, 5):
            o["pipeline.vocab_parallel"] = True
        if _rare(draw, 6):
            o["pipeline.layout"] = "auto"
    layers = [n for n in (2, 4, 8) if n % stages == 0] or [8]
    num_layers = draw(st.sampled_from((3, 6))) if _rare(draw, 10) else draw(st.sampled_from(layers[:2]))
    o["model.num_layers"] = num_layers
    if pipe == 1 and _rare(draw, 4):
        o["train.microbatches"] = 2  # gradient accumulation

    seq = sizes["seq"]
    if seq > 1 or _rare(draw, 10):
        # dense over seq > 1 is refused: drawn rarely
        attention = _pick(draw, ("ulysses", "ring", "usp", "allgather", "dense"), 2, 2, 2, 2, 1 if seq > 1 else 12)
        if attention != "dense":
            o["model.attention"] = attention
        if attention == "allgather" and draw(st.booleans()):
            o["model.seq_layout"] = "balanced"
        if attention == "usp" and seq > 2 and draw(st.booleans()):
            o["model.ulysses_degree"] = 2
    remat = _pick(draw, ("none", "full", "dots", "offload"), 3, 1, 1, 1)
    if remat != "none":
        o["model.remat"] = remat
    if family == "llama" and _rare(draw, 4):
        o["model.mlp_chunks"] = 2
    if family == "moe":
        if _rare(draw, 5) and (sizes["expert"] == 1 or _rare(draw, 4)):
            o["model.moe.dispatch"] = "ragged"  # dropless: one expert rank only (no ragged_all_to_all on XLA:CPU)
        if sizes["expert"] > 1 and draw(st.booleans()):
            o["model.moe.dispatch_chunks"] = 2
        if _rare(draw, 4):
            o["model.moe.capacity_factor"] = 0.0  # drops nothing
    optimizer = _pick(draw, ("adamw", "muon", "sgd"), 4, 2, 1)
    if optimizer != "adamw":
        o["optim.name"] = optimizer
    if _rare(draw, 10) and (pipe == 1 or not KINDS[schedule].steady or _rare(draw, 4)):
        o["optim.grad_delay"] = 1  # 2bw delays the gradient itself: refused with it
    if _rare(draw, 10):
        o["optim.offload_state"] = True
    if _rare(draw, 7):
        o["model.dtype"] = "bfloat16"
    if sizes["replica"] > 1:
        o["diloco.sync_every"] = _pick(draw, (1, 2))
        if _rare(draw, 3):
            o["diloco.fragments"] = 2
            if draw(st.booleans()):
                o["diloco.overlap"] = 1
        dtype = _pick(draw, ("float32", "bfloat16", "int8"), 2, 1, 1)
        if dtype != "float32":
            o["diloco.pseudo_grad_dtype"] = dtype
    return Case(family, tuple(o.items()))


# ---------------------------------------------------------------- the check of one case

@dataclasses.dataclass
class Outcome:
    status: str  # refused | ok | FAIL
    detail: str = ""
    seconds: float = 0.0
    mode: str = ""  # ok: parity | delayed | finite


def mode_of(config) -> str:
    """How a run that trains is held: parity (one device's numbers), delayed (2bw: one device with a one-step
    gradient delay, from the second step) or finite (bfloat16, DiLoCo: finite losses, exact resume)."""
    if str(config.model.dtype) != "float32" or int(config.mesh.replica) > 1:
        return "finite"
    kind = KINDS.get(str(config.pipeline.schedule))
    if int(config.mesh.pipe) > 1 and kind is not None and kind.steady:
        return "delayed"
    return "parity"


def reference_config(config, delayed=False):
    """The 1-device config of the same numbers: every layout choice at its default (mesh 1, no pipeline,
    dense attention, no remat, no MLP / dispatch chunks, no accumulation, no offloaded optimizer state)."""
    from parallax.defaults import default_config

    ref = config.copy_and_resolve_references()
    defaults = default_config(model=str(config.model.name))
    for axis in ref.mesh:
        ref.mesh[axis] = 1
    for key in ref.pipeline:
        ref.pipeline[key] = defaults.pipeline[key]
    for key in ("attention", "seq_layout", "ulysses_degree", "remat"):
        ref.model[key] = defaults.model[key]
    if "mlp_chunks" in ref.model:
        ref.model.mlp_chunks = 1
    if "moe" in ref.model:
        ref.model.moe.dispatch_chunks = 1
    ref.train.microbatches = 1
    ref.optim.offload_state = False
    if delayed:
        ref.optim.grad_delay = 1
    return ref


def reference_key(ref) -> str:
    return ref.to_json_best_effort(sort_keys=True)


_REFERENCES: dict = {}


def reference(ref):
    """(first loss, first gradients, 2 step losses) on one device, computed once per distinct config."""
    key = reference_key(ref)
    if key not in _REFERENCES:
        from helpers import loss_grads_and_steps
        _REFERENCES[key] = loss_grads_and_steps(ref, jax.devices()[:1], steps=2)
    return _REFERENCES[key]


def _one_line(e: ConfigError) -> Outcome:
    message = str(e)
    if "\n" in message or not message.strip():
        return Outcome("FAIL", f"ConfigError message is not one line: {message!r}")
    return Outcome("refused", message)


def check(case: Case) -> Outcome:
    """Refused with one line, or trained, evaluated, checkpointed, resumed exactly and (where it must)
    equal to one device. Never raises: a failure is an Outcome with the reason."""
    start = time.perf_counter()
    outcome = _check(case)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _check(case: Case) -> Outcome:
    try:
        config = case.config()
        make_plan(config, DEVICES)
    except ConfigError as e:
        return _one_line(e)
    except Exception as e:  # noqa: BLE001 -- a crash of the plan is a failure, reported
        return Outcome("FAIL", f"make_plan raised {type(e).__name__}: {_first(e)}")
    cache = jax.config.jax_persistent_cache_min_compile_time_secs
    if str(config.pipeline.schedule) == "dualpipev" and int(config.mesh.pipe) > 1:
        # an XLA:CPU executable of dualpipev's fused tick loaded from the persistent cache computes wrong
        # values now and then (tests/conftest.py): write none
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        return _train_and_compare(case, config)
    except ConfigError as e:
        return _one_line(e)
    except AssertionError as e:
        return Outcome("FAIL", _first(e) or "assertion failed")
    except Exception as e:  # noqa: BLE001
        return Outcome("FAIL", f"{type(e).__name__}: {_first(e)} [{_where(e)}]")
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", cache)


def _first(e) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else ""


def _where(e) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/parallax/" in f.filename]
    f = (frames or traceback.extract_tb(e.__traceback__))[-1]
    return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}"


def _train_and_compare(case, config) -> Outcome:
    from helpers import max_leaf_rel_err, rel_err
    from parallax.train import make_dataset, train_and_evaluate

    mode = mode_of(config)
    with tempfile.TemporaryDirectory(prefix="sweep-") as workdir:
        first = train_and_evaluate(config.copy_and_resolve_references(), workdir, devices=jax.devices(),
                                   log=lambda *_: None)
        if first.preempted:  # the run caught a SIGTERM / SIGINT meant for the sweep: stop here, not a FAIL
            raise KeyboardInterrupt(f"case stopped by signal {first.stop_signal} (a preemption); sweep ends")
        losses = [r["loss"] for r in first.history if "loss" in r]
        assert [r["step"] for r in first.history] == [1, 2], f"logged steps {[r['step'] for r in first.history]}"
        want = 1 if mode == "delayed" else 2  # 2bw's first step completes no batch
        assert len(losses) == want and all(np.isfinite(losses)), f"step losses {losses}"
        assert first.eval_loss is not None and np.isfinite(first.eval_loss), f"eval loss {first.eval_loss}"
        assert os.path.isdir(os.path.join(workdir, "checkpoints", "2")), \
            f"no checkpoint of step 2: {os.listdir(os.path.join(workdir, 'checkpoints'))}"
        again = train_and_evaluate(config.copy_and_resolve_references(), workdir, devices=jax.devices(),
                                   log=lambda *_: None)  # restores step 2, trains nothing
        assert int(again.state["step"]) == 2 and not again.history
        saved, restored = jax.device_get(first.state), jax.device_get(again.state)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(saved)[0], jax.tree.leaves(restored)):
            assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True), \
                f"resumed state {jax.tree_util.keystr(path)} differs from the saved one"
        if mode == "finite":
            return Outcome("ok", f"losses {_fmt(losses)} eval {first.eval_loss:.4f}", mode=mode)
        ref_loss, ref_grads, ref_losses = reference(reference_config(config, delayed=mode == "delayed"))
        if mode == "delayed":
            np.testing.assert_allclose(losses, ref_losses[:1], rtol=TOL,
                                       err_msg="2bw step 2 vs delayed 1-device step 1")
            return Outcome("ok", f"loss {losses[0]:.6f} = delayed 1-device", mode=mode)
        trainer = first.trainer
        params = trainer.init_state()["params"]
        batch = trainer.device_batch(make_dataset(config).batch(0))
        loss, grads = jax.device_get(trainer.loss_and_grads(params, batch))
    loss_err = rel_err(loss, ref_loss)
    grad_err, where = max_leaf_rel_err(grads, ref_grads)
    assert loss_err <= TOL, f"first loss {float(loss):.7f} vs 1 device {ref_loss:.7f}: rel err {loss_err:.2e}"
    assert grad_err <= TOL, f"gradient {where} differs from 1 device by {grad_err:.2e}"
    step_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert step_err <= TOL, f"step losses {_fmt(losses)} vs 1 device {_fmt(ref_losses)}: rel err {step_err:.2e}"
    return Outcome("ok", f"loss {loss_err:.1e} grads {grad_err:.1e} steps {step_err:.1e}", mode=mode)


def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.6f}" for x in xs) + "]"


# ---------------------------------------------------------------- running many

def run_sweep(examples: int, seed_value: int, out=print, isolate=False, first=1) -> list[tuple[Case, Outcome]]:
    """Distinct cases `first` .. `first + examples - 1` drawn by hypothesis from `seed_value` (no shrinking, no
    database), each checked and printed as it ends; returns (case, outcome) pairs (a draw equal to an earlier
    one is skipped: hypothesis repeats about half; its first draw is always the simplest, plain data
    parallelism). `isolate`: each case that the plan accepts runs in its own process
    (`check_in_subprocess`), so that a crash or a hang of XLA is one failure, not the end of the sweep."""
    results, seen = [], []
    last = first + examples - 1

    @seed(seed_value)
    @settings(max_examples=10 * last, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def run(case):
        if case in seen or len(seen) >= last:
            return
        seen.append(case)
        if len(seen) < first:
            return
        outcome = check_in_subprocess(case) if isolate else check(case)
        results.append((case, outcome))
        out(f"[{len(seen)}] {outcome.status:7s} {outcome.seconds:6.1f}s {outcome.mode:7s} {case.describe()}"
            + (f"  | {outcome.detail}" if outcome.detail else ""))

    run()
    return results


def check_in_subprocess(case: Case, timeout=600) -> Outcome:
    """`check` in a process of its own (the plan's refusals in this one: they compile nothing). A process that
    dies or hangs is a failure; it is run once more without the persistent compilation cache, and the
    failure says whether that run passed (XLA:CPU executables loaded from the cache have computed wrong
    values and hung in collectives: tests/conftest.py)."""
    import json
    import subprocess

    start = time.perf_counter()
    try:
        make_plan(case.config(), DEVICES)
    except ConfigError as e:
        return dataclasses.replace(_one_line(e), seconds=time.perf_counter() - start)
    except Exception:  # noqa: BLE001 -- the child reports it
        pass

    def child(env):
        command = [sys.executable, os.path.abspath(__file__), f"--config={case.file}", *case.flags(fixed=False),
                   "--json"]
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome("FAIL", f"no result in {timeout} s (a hang)")
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            return Outcome(**json.loads(lines[-1]))
        fatal = [line for line in done.stderr.splitlines() if line[:1] in "FE" and "]" in line
                 or "Error" in line or "Check failed" in line]
        return Outcome("FAIL", f"the process died (rc {done.returncode}): {(fatal or ['?'])[-1][:300]}")

    outcome = child(dict(os.environ))
    if outcome.status == "FAIL" and outcome.detail.startswith(("the process died", "no result")):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
        again = child({**env, "PARALLAX_TEST_NO_CACHE": "1"})
        outcome.detail += (f"; without the compilation cache: {again.status}"
                           + (f" ({again.detail[:200]})" if again.status == "FAIL" else ""))
    outcome.seconds = time.perf_counter() - start
    return outcome


def summary(results, seed_value, examples, first=1) -> str:
    counts = {s: sum(o.status == s for _, o in results) for s in ("refused", "ok", "FAIL")}
    ran = [o for _, o in results if o.status != "refused"]
    modes = {m: sum(o.mode == m for _, o in results if o.status == "ok") for m in ("parity", "delayed", "finite")}
    total = sum(o.seconds for _, o in results)
    lines = [f"sweep seed {seed_value}: {len(results)} drawn, {counts['refused']} refused, {len(ran)} ran: "
             f"{counts['ok']} passed ({', '.join(f'{n} {m}' for m, n in modes.items())}), {counts['FAIL']} failed; "
             f"{total:.0f} s, {total / max(1, len(results)):.1f} s per example "
             f"({sum(o.seconds for o in ran) / max(1, len(ran)):.1f} s per run, "
             f"{sum(o.seconds for _, o in results if o.status == 'refused') / max(1, counts['refused']):.2f} s "
             "per refusal)"]
    for case, outcome in results:
        if outcome.status == "FAIL":
            lines.append(f"FAIL: {outcome.detail}\n  reproduce: {case.command()}\n  (or the whole run: "
                         f"python tests/sweep.py --examples={examples} --seed={seed_value}"
                         + (f" --first={first}" if first != 1 else "") + ")")
    return "\n".join(lines)


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=1, help="check the distinct draws from this one on (1: all)")
    parser.add_argument("--config", help="check one case: a config file of configs/ and --config.KEY=VALUE flags")
    parser.add_argument("--in_process", action="store_true", help="run every case in this process (faster: the "
                        "1-device references are shared; a crash of XLA ends the sweep)")
    parser.add_argument("--json", action="store_true", help="one case: print its outcome as JSON")
    args, rest = parser.parse_known_args(argv)
    sys.path.insert(0, HERE)
    if args.config:  # one case, as a failure's line prints it
        family = {v: k for k, v in FILES.items()}[os.path.relpath(os.path.join(ROOT, args.config), ROOT)]
        fixed = dict(FIXED)
        overrides = []
        for flag in rest:
            key, _, value = flag.removeprefix("--config.").partition("=")
            if key not in fixed:
                overrides.append((key, value))
        case = Case(family, tuple(overrides))
        outcome = check(case)
        if args.json:
            import json
            print(json.dumps(dataclasses.asdict(outcome)), flush=True)
            return 0
        print(f"{outcome.status} {outcome.seconds:.1f}s {outcome.mode} {case.describe()}  | {outcome.detail}")
        return 0 if outcome.status != "FAIL" else 1
    results = run_sweep(args.examples, args.seed, out=lambda line: print(line, flush=True),
                        isolate=not args.in_process, first=args.first)
    print(summary(results, args.seed, args.examples, args.first), flush=True)
    return 0 if all(o.status != "FAIL" for _, o in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
