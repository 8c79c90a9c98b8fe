"""Benchmarks (not tests): step time and tokens/s per mesh, and pipeline schedules' compiled memory and time.

    python launch/bench.py --cpu_devices=8 [--part=all|mesh|pipeline] [--steps=5]
    python launch/bench.py --cpu_devices=64 --part=muon   # Newton-Schulz on the 8B / 70B shapes (compile only)
    python launch/bench.py --part=data [--data_gb=1] [--data_dir=/tmp/parallax_bench_data]   # prepare_data
    python launch/bench.py --part=device --cpu_devices=0 [--steps=30]  # on a GPU / TPU machine: tokens/s/chip, MFU
    python launch/bench.py --part=device --smoke                       # the same script, tiny, on CPU (a test)
    python launch/bench.py --part=generate --cpu_devices=1             # decode tokens/s, KV cache vs none
    python launch/bench.py --part=balance --cpu_devices=1              # pipeline layouts of Llama 3 8B: per-rank work
    python launch/bench.py --part=diloco --cpu_devices=4 --steps=800   # DiLoCo vs data parallel: eval loss
    python launch/bench.py --part=overlap --topology=v5p:2x2x1          # dualpipev's overlapped all-to-alls
    python launch/bench.py --part=packs                                # context-parallel work: zigzag vs balanced
    python launch/bench.py --part=memory --cpu_devices=64              # docs/memory.md's table: XLA:CPU's peaks
    python launch/bench.py --part=split                                # the split backward's counted FLOPs
    python launch/bench.py --part=quant --steps=800                    # 8-bit vs unquantized: eval loss (quickstart)
    python launch/bench.py --part=quant --quant_model=bpe --steps=400  # the same, 8 x 256 Llama on a BPE corpus
    python launch/bench.py --part=rank --cpu_devices=8                 # the step-time estimate's ranking vs measured
                                                                       # (Python 3.12 + libtpu, compile only)

Prints markdown tables. On simulated CPU devices the times measure the program, not a real interconnect;
the memory figures are XLA's own (`compiled.memory_analysis()`, per device); the Muon figures are XLA's
cost analysis and the collectives of the compiled optimizer update, per device.
"""

import math
import os
import sys
import time


from absl import app, flags

from launch.common import parse_flags
from parallax.pipeline.schedule import DEFAULT, KINDS  # numpy only: imports nothing that starts jax

# --part=balance: every flushing schedule of a fixed chunk count that runs one action a tick;
# --part=overlap: every schedule that pairs a forward with a backward beside the first unpaired one of
# the same placement (2 chunks: zbv).
BALANCE_SCHEDULES = [n for n, k in KINDS.items() if k.flushes and not k.pairs and k.chunks in (1, 2)]
OVERLAP_SCHEDULES = [n for n, k in KINDS.items() if k.chunks == 2 and not k.pairs][:1] + [
    n for n, k in KINDS.items() if k.pairs]

flags.DEFINE_integer("cpu_devices", 8, "Simulated CPU devices (0: use the real devices).", lower_bound=0)
flags.DEFINE_enum("part", "all", ["all", "mesh", "pipeline", "balance", "muon", "data", "device", "generate",
                                  "diloco", "overlap", "packs", "memory", "split", "quant", "rank"],
                  "Which benchmark to run (all: mesh + pipeline).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "--part=quant: the compute dtype of every run.")
flags.DEFINE_enum("quant_model", "quickstart", ["quickstart", "bpe"],
                  "--part=quant: the quickstart (byte-level, 4 x 128), or a larger Llama (8 layers, d_model 256) on a "
                  "BPE of 4,096 ids trained on the standard library's sources.")
flags.DEFINE_string("modes", "none,int8,fp8,fp8_block", "--part=quant: the quant.mode values to run, the first the "
                    "baseline.")
flags.DEFINE_bool("smoke", False, "--part=device: tiny models and 2 steps (checks the script on CPU).")
flags.DEFINE_float("data_gb", 1.0, "--part=data: gigabytes of generated jsonl to prepare.", lower_bound=1e-6)
flags.DEFINE_string("data_dir", "/tmp/parallax_bench_data", "--part=data: scratch directory (several GB).")
flags.DEFINE_list("schedules", list(KINDS),
                  "--part=pipeline: the schedules to measure.")
flags.DEFINE_integer("steps", 5, "Timed steps per configuration (after one compile step); --part=diloco: "
                     "training steps.", lower_bound=1)
flags.DEFINE_string("topology", "v5p:2x2x1", "--part=overlap: the TPU slice to compile for (libtpu, ahead of time).")
flags.register_validator("schedules", lambda names: set(names) <= set(KINDS),
                         f"unknown schedule; known: {', '.join(KINDS)}")
FLAGS = flags.FLAGS


def _config(**mesh):
    from parallax.defaults import default_config

    config = default_config(model="llama")
    for axis in config.mesh:
        config.mesh[axis] = mesh.pop(axis, 1)
    config.model.update(num_layers=8, d_model=128, num_heads=4, num_kv_heads=2, d_ff=256, vocab_size=256)
    config.train.update(global_batch_size=16, seq_len=128)
    config.data.source = "synthetic"
    for key, value in mesh.items():  # dotted leftovers such as model__attention="ring"
        section, name = key.split("__")
        config[section][name] = value
    return config


def _time_steps(trainer, dataset, steps):
    import time

    import jax

    state = trainer.init_state()
    state, metrics = trainer.train_step(state, trainer.device_batch(dataset.batch(0)))  # compile
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        state, metrics = trainer.train_step(state, trainer.device_batch(dataset.batch(step)))
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps, float(metrics["loss"])


def bench_meshes(steps):
    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    cases = [("1 device", dict(), 1), ("data=8", dict(data=8), 8), ("fsdp=8", dict(fsdp=8), 8),
             ("data=2 fsdp=4", dict(data=2, fsdp=4), 8), ("data=4 tensor=2", dict(data=4, tensor=2), 8),
             ("data=4 seq=2 ulysses", dict(data=4, seq=2, model__attention="ulysses"), 8),
             ("data=4 seq=2 ring", dict(data=4, seq=2, model__attention="ring"), 8),
             ("data=4 pipe=2 1f1b", dict(data=4, pipe=2), 8)]
    import jax

    print("| mesh | step time (s) | tokens/s | loss after steps |\n|---|---|---|---|")
    for name, mesh, devices in cases:
        config = _config(**mesh)
        trainer = Trainer(config, devices=jax.devices()[:devices])
        dt, loss = _time_steps(trainer, make_dataset(config), steps)
        tokens = config.train.global_batch_size * config.train.seq_len
        print(f"| {name} | {dt:.3f} | {tokens / dt:,.0f} | {loss:.4f} |", flush=True)


RANK_MESHES = [("data=8", dict(data=8)), ("fsdp=8", dict(fsdp=8)), ("data=2 fsdp=4", dict(data=2, fsdp=4)),
               ("data=4 tensor=2", dict(data=4, tensor=2)), ("fsdp=4 tensor=2", dict(fsdp=4, tensor=2)),
               ("data=4 pipe=2 1f1b", dict(data=4, pipe=2)), ("data=2 pipe=4 1f1b", dict(data=2, pipe=4)),
               ("data=4 seq=2 ring", dict(data=4, seq=2, model__attention="ring"))]


def bench_rank(steps, repeats=3):
    """The step-time estimate (`parallax.estimate`, from the counted costs of each compiled step) against the
    measured step time of the bench model on 8 simulated CPU devices, for `RANK_MESHES`. A CPU has no
    interconnect and no published figures: its four constants (matmul FLOP/s, memory bytes/s, collective
    bytes/s and seconds per collective, the simulated devices sharing the host's cores) are fitted once, to
    these measurements (least squares of the log step time), and printed. Noise: each mesh is timed `repeats`
    times; a pair of meshes counts where the estimates differ by more than the two measurements' spreads."""
    import jax
    import numpy as np
    from scipy.optimize import minimize

    from parallax.estimate import Chip, estimate
    from parallax.memory import memory_report
    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    rows = []
    for name, mesh in RANK_MESHES:
        config = _config(**mesh)
        devices = jax.devices()[:8]
        trainer = Trainer(config, devices=devices)
        dataset = make_dataset(config)
        times = sorted(_time_steps(trainer, dataset, steps)[0] for _ in range(repeats))
        costs = memory_report(config, devices).costs
        rows.append((name, float(np.median(times)), times[-1] - times[0], costs))
        print(f"measured {name}: {rows[-1][1]:.4f} s (spread {rows[-1][2]:.4f})", file=sys.stderr, flush=True)

    def chip(log_rates):
        flops, memory, link, latency = np.exp(log_rates)
        return Chip("CPU (fitted)", flops, None, memory, link=link, dcn=None, source="fitted to these measurements",
                    latency=latency)

    def loss(log_rates):
        c = chip(log_rates)
        return sum((np.log(estimate(costs, c).seconds) - np.log(t)) ** 2 for _, t, _, costs in rows)
    fitted = minimize(loss, np.log([1e10, 1e10, 1e9, 1e-5]), method="Nelder-Mead", options=dict(maxiter=8000)).x
    cpu = chip(fitted)
    est = [estimate(costs, cpu).seconds for *_, costs in rows]
    measured = [t for _, t, _, _ in rows]
    print(f"CPU constants (fitted once): {cpu.peak_bf16 / 1e9:.3g} GFLOP/s in matmuls, {cpu.hbm / 1e9:.3g} GB/s "
          f"memory traffic, {cpu.link / 1e9:.3g} GB/s collectives + {cpu.latency * 1e6:.3g} us each (per "
          f"simulated device, all exposed: XLA:CPU runs collectives synchronously)\n")
    order_m = {rows[i][0]: k + 1 for k, i in enumerate(np.argsort(measured))}
    order_e = {rows[i][0]: k + 1 for k, i in enumerate(np.argsort(est))}
    print("| mesh | measured step (s) | spread | FLOPs / device | bytes / device | collectives (count, bytes sent) "
          "| estimated (s) | rank measured | rank estimated |\n|---|---|---|---|---|---|---|---|---|")
    for (name, t, spread, costs), e in zip(rows, est):
        count = sum(c["count"] for c in costs.collectives.values() if c["sent"])
        unknown = f" ({costs.unknown_loops} loops of unknown trip count)" if costs.unknown_loops else ""
        print(f"| {name}{unknown} | {t:.4f} | {spread:.4f} | {costs.flops:.3g} | {costs.bytes:.3g} | {count:g}, "
              f"{sum(costs.by_axes('sent').values()):.3g} | {e:.4f} | {order_m[name]} | {order_e[name]} |")
    pairs, wrong = 0, []
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if abs(est[i] - est[j]) > rows[i][2] + rows[j][2]:  # the estimates differ by more than the noise
                pairs += 1
                if (measured[i] < measured[j]) != (est[i] < est[j]):
                    wrong.append(f"{rows[i][0]} / {rows[j][0]}")
    print(f"\npairs whose estimates differ by more than the two measurements' spreads: {pairs}; ordered as "
          f"measured: {pairs - len(wrong)}" + (f"; not: {', '.join(wrong)}" if wrong else ""))


def bench_pipeline(steps, schedules):
    import math

    import jax

    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    from parallax.steps import SteadyPipelinePath
    from parallax.pipeline import work
    from parallax.pipeline.program import compile_schedule

    print("\n| schedule | p | m | ticks | matmul GFLOP per step (counted per branch) | temp MiB (compiled) |"
          "\n|---|---|---|---|---|---|")
    timed = {}  # schedule -> (trainer, dataset) at m = 8
    for schedule in schedules:
        for m in (8, 16):
            config = _config(data=2, pipe=4)
            config.train.global_batch_size = 2 * m * 2
            config.pipeline.update(schedule=schedule, microbatches=m,
                                   virtual_stages=KINDS[schedule].virtual_stages(2))
            trainer = Trainer(config, devices=jax.devices()[:8])
            dataset = make_dataset(config)
            state = trainer.init_state()
            batch = trainer.device_batch(dataset.batch(0))
            step = trainer._loss_and_grads
            if isinstance(trainer.path, SteadyPipelinePath):  # 2bw: one window, finishing the previous batch
                def step(state, batch):
                    pipe = state["pipeline"]
                    return trainer.path.window(pipe["previous"], state["params"], pipe["batch"], batch,
                                               pipe["inflight"])
            else:
                state = state["params"]
            compiled = jax.jit(step).lower(state, batch).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            jaxpr = jax.make_jaxpr(step)(state, batch)
            gflop = work.step_flops(jaxpr, compile_schedule(trainer.plan.schedule))["total"] / 1e9
            held = f"{temp:.2f}"
            if trainer.path.state_keys:  # 2bw: its slots and inbox are arguments (kept in the train state), not temp
                inflight = jax.tree.leaves(state["pipeline"]["inflight"])  # leading dim: the devices
                held += f" + {sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in inflight) / 2**20:.2f} in flight"
            print(f"| {schedule} | 4 | {m} | {trainer.pipeline.num_ticks} | {gflop:.3f} | {held} |", flush=True)
            if m == 8:
                timed[schedule] = trainer, dataset
    _time_interleaved(timed, steps)


def bench_balance():
    """Llama 3 8B (128,256 vocabulary) at pipe 4 and 8: per-rank parameters and counted FLOPs, and the
    simulator's step time at per-stage costs from those FLOPs, for even and `auto` layouts, without and with
    the vocabulary-parallel head (no compile; async: n/a with it, a pass every rank runs in one tick)."""
    import numpy as np

    from parallax.defaults import config_from_args
    from parallax.steps.pipeline import rank_balance
    from parallax.pipeline.simulate import flop_costs, simulate
    from parallax.plan import make_plan

    print("\n| pipe | m | schedule | vocab_parallel | layout | layers per stage | params max/min | FLOPs max/min | "
          "lockstep time / ideal | async time / ideal |\n|---|---|---|---|---|---|---|---|---|---|")
    for p in (4, 8):
        for schedule, vocab, layout in [(s, vp, lay) for s in BALANCE_SCHEDULES
                                        for vp in (False, True) for lay in ("even", "auto")]:
            if True:
                config = config_from_args("configs/llama3_8b.py", [])
                config.mesh.update(data=1, fsdp=8, tensor=1, pipe=p)
                config.train.microbatches = 1
                v = KINDS[schedule].virtual_stages(1)
                config.pipeline.update(schedule=schedule, virtual_stages=v, microbatches=4 * p, layout=layout,
                                       vocab_parallel=vocab)
                plan = make_plan(config, 8 * p, "tpu")
                rows, flops = rank_balance(plan), plan.parts.flops(plan.remat)
                costs = flop_costs(plan.schedule, 32, flops["layer"], flops["embed"], flops["loss"], vocab)
                total = sum(np.sum(costs[k]) for k in ("F", "B", "W")) + 3 * flops["loss"] * vocab
                ideal = total * plan.schedule.num_microbatches / p
                times = [simulate(plan.schedule, costs, mode).total_time / ideal if mode == "lockstep" or not vocab
                         else float("nan") for mode in ("lockstep", "async")]
                ratio = [max(r[k] for r in rows) / min(r[k] for r in rows) for k in ("params", "flops")]
                layers = ",".join(map(str, plan.schedule.stage_layers(32)))
                print(f"| {p} | {4 * p} | {schedule} | {'yes' if vocab else 'no'} | {layout} | {layers} | "
                      f"{ratio[0]:.2f} | {ratio[1]:.2f} | {times[0]:.3f} | {times[1]:.3f} |", flush=True)


def _time_interleaved(timed, steps, rounds=5):
    """Median train-step time per schedule, the schedules taking turns (`rounds` rounds of `steps` steps
    each), so that a slow spell of the machine does not fall on one schedule only."""
    import time

    import jax
    import numpy as np

    states = {}
    for name, (trainer, dataset) in timed.items():  # compile, and one step
        states[name] = trainer.train_step(trainer.init_state(), trainer.device_batch(dataset.batch(0)))
        jax.block_until_ready(states[name])
    times = {name: [] for name in timed}
    for r in range(rounds):
        for name, (trainer, dataset) in timed.items():
            state, _ = states[name]
            for k in range(steps):
                batch = trainer.device_batch(dataset.batch(1 + r * steps + k))
                start = time.perf_counter()
                state, metrics = trainer.train_step(state, batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - start)
            states[name] = state, metrics
    base = float(np.median(times.get(DEFAULT, next(iter(times.values())))))
    print(f"\nstep time at m = 8, median of {rounds} x {steps} steps (schedules taking turns):\n"
          "| schedule | step time (s) | / 1f1b |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {np.median(t):.3f} | {np.median(t) / base:.2f} |", flush=True)


def bench_muon():
    """Muon's optimizer update on the real configs' shapes, compiled for their meshes (abstract parameters,
    nothing allocated): XLA partitioning Newton-Schulz on the sharded matrices (plain) vs the stack
    resharded to whole matrices spread over all devices (parallax's)."""
    import math

    import jax

    from parallax import hlo, optim
    from parallax.defaults import load_config_file
    from parallax.trainer import Trainer, _opt_state_shardings

    print("\n| config | devices | Newton-Schulz | FLOPs per device | collectives | bytes moved per device |\n"
          "|---|---|---|---|---|---|")
    for path in ("configs/llama3_8b.py", "configs/llama3_70b.py"):
        config = load_config_file(path)
        config.optim.name = "muon"
        n = 1
        for axis in config.mesh:
            n *= max(int(config.mesh[axis]), 1)
        if n > len(jax.devices()):
            print(f"| {path} | {n} | skipped: run with --cpu_devices={n} | | | |")
            continue
        trainer = Trainer(config, devices=jax.devices()[:n])
        params = trainer.abstract_state()["params"]
        for label, mesh in (("plain", None), ("spread", trainer.mesh)):
            tx = optim.make_optimizer(optim.resolve(config.optim), 100, trainer.logical, mesh)
            state = jax.eval_shape(tx.init, params)
            shardings = (trainer.param_shardings, _opt_state_shardings(state, trainer.param_shardings, trainer.mesh),
                         trainer.param_shardings)
            compiled = jax.jit(tx.update, in_shardings=shardings).lower(params, state, params).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            moved = sum(math.prod(shape) * 4 for _, shapes in hlo.collective_shapes(compiled)  # fp32 updates
                        for shape in shapes)
            counts = ", ".join(f"{v} {k}" for k, v in sorted(hlo.count_collectives(compiled).items()) if v)
            print(f"| {os.path.basename(path)} | {n} | {label} | {cost['flops']:.3g} | {counts} | "
                  f"{moved / 2**30:.1f} GiB |", flush=True)


def _generate_jsonl(path, gigabytes):
    """Deterministic English-like documents (a Zipf draw over 8,000 made-up words), one JSON line each."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, int(rng.integers(1, 10)), p=None)) for _ in range(8000)]
    rank = np.arange(1, len(vocab) + 1)
    p = (1.0 / rank) / (1.0 / rank).sum()
    target, written = int(gigabytes * 2**30), 0
    with open(path + ".tmp", "w") as f:
        while written < target:
            lengths = rng.integers(50, 1500, 256)
            words = rng.choice(len(vocab), int(lengths.sum()), p=p)
            at = 0
            for n in lengths:
                line = json.dumps({"text": " ".join(vocab[w] for w in words[at:at + n]) + "."}) + "\n"
                at += n
                f.write(line)
                written += len(line)
    os.replace(path + ".tmp", path)


def _measured(command, **kw):
    """(seconds, peak RSS MiB of the largest process, stdout) of a command run in a fresh process."""
    import resource
    import subprocess

    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); r = subprocess.run(sys.argv[1:]); "
             "print(f'BENCH {time.perf_counter() - t} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}'); "
             "sys.exit(r.returncode)")
    out = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, **kw)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    _, seconds, rss = out.stdout.strip().splitlines()[-1].split()
    del resource
    return float(seconds), int(rss) / 1024, out.stdout


def bench_data(gigabytes, scratch):
    """launch/prepare_data.py on generated jsonl: tokens/s and peak RSS with 1 and 2 worker processes, a
    SIGKILL mid-run and a restart (hashes compared), then first-batch latency and RSS of a 100-shard directory
    against one token file of the same tokens."""
    import glob
    import hashlib
    import json
    import signal
    import subprocess
    import time

    import numpy as np

    from parallax import corpus as shard_lib
    from parallax.prepare import iter_texts
    from parallax.tokenizer import train_bpe

    os.makedirs(scratch, exist_ok=True)
    corpus = os.path.join(scratch, f"corpus-{gigabytes:g}gb.jsonl")
    if not os.path.exists(corpus):
        t = time.perf_counter()
        _generate_jsonl(corpus, gigabytes)
        print(f"generated {corpus} ({os.path.getsize(corpus) / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s")
    bpe = os.path.join(scratch, "bpe")
    if not os.path.exists(os.path.join(bpe, "tokenizer.json")):
        train_bpe(iter_texts([corpus], max_bytes=32 << 20), 4096, bpe, show_progress=False)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_data.py")

    def command(out, workers):
        return [sys.executable, script, f"--inputs=web={corpus}", f"--tokenizer={bpe}", f"--output={out}",
                f"--workers={workers}", "--noprogress"]

    def digests(directory):
        return {os.path.basename(p): hashlib.sha256(open(p, "rb").read()).hexdigest()
                for p in sorted(glob.glob(os.path.join(directory, "*"))) if os.path.isfile(p)
                and not p.endswith("prepare.json")}

    print(f"\n| prepare_data, {os.path.getsize(corpus) / 2**30:.2f} GiB jsonl, BPE 4096 | seconds | tokens/s | "
          "MB/s of input | peak RSS (largest process) |\n|---|---|---|---|---|")
    runs = {}
    for workers in (1, 2):
        out = os.path.join(scratch, f"shards-w{workers}")
        subprocess.run(["rm", "-rf", out], check=True)
        seconds, rss, _ = _measured(command(out, workers))
        tokens = shard_lib.read_manifest(out)["tokens"]
        runs[workers] = digests(out)
        print(f"| {workers} worker{'s' * (workers > 1)} | {seconds:.0f} | {tokens / seconds:,.0f} | "
              f"{os.path.getsize(corpus) / 1e6 / seconds:.1f} | {rss:,.0f} MiB |", flush=True)
    same = runs[1] == runs[2]
    killed = os.path.join(scratch, "shards-killed")
    subprocess.run(["rm", "-rf", killed], check=True)
    proc = subprocess.Popen(command(killed, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while len(glob.glob(os.path.join(killed, "*.docs.npy"))) < max(1, len(runs[1]) // 4):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(glob.glob(os.path.join(killed, "*.docs.npy")))
    seconds, _, _ = _measured(command(killed, 2))
    print(f"\n1 and 2 workers byte-identical: {same} ({len(runs[1])} files). Killed (SIGKILL) with {done} shards "
          f"committed, restarted: finished in {seconds:.0f} s, byte-identical to the uninterrupted run: "
          f"{digests(killed) == runs[1]}")

    # 100 shards against one file of the same tokens (cut from the 1-worker run: no second tokenization).
    source = os.path.join(scratch, "shards-w1")
    manifest = shard_lib.read_manifest(source)
    streams = [shard_lib.Shard(source, e, manifest["dtype"]) for e in manifest["shards"]]
    tokens = np.concatenate([np.asarray(s.tokens) for s in streams])
    starts = np.concatenate([np.asarray(s.starts) + o for s, o in zip(streams, np.cumsum([0] + [s.n_tokens for s
                                                                                               in streams[:-1]]))])
    single = os.path.join(scratch, "single.uint16.bin")
    tokens.tofile(single)
    hundred = os.path.join(scratch, "shards-100")
    subprocess.run(["rm", "-rf", hundred], check=True)
    os.makedirs(hundred)
    cuts = starts[np.searchsorted(starts, np.linspace(0, len(tokens), 101)[1:-1])]
    bounds = [0, *cuts.tolist(), len(tokens)]
    entries = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        inner = starts[(starts >= a) & (starts < b)] - a
        docs = np.split(tokens[a:b], inner[1:])
        entries.append(shard_lib.write_shard(hundred, f"web-{k:05d}", docs, "uint16") | {"source": "web"})
    manifest = {**manifest, "shards": entries}
    with open(os.path.join(hundred, shard_lib.MANIFEST), "w") as f:
        json.dump(manifest, f)
    subprocess.run(["cp", "-r", os.path.join(source, "tokenizer"), hundred], check=True)
    first = ("import sys, time; from parallax.data import make_dataset; t = time.perf_counter(); "
             "d = make_dataset('tokens', sys.argv[1], seq_len=2048, global_batch_size=64, seed=0, vocab_size=4096, "
             "eos_id=0); b = d.batch(0); print('FIRST', time.perf_counter() - t)")
    print(f"\n| corpus of {len(tokens):,} tokens | make_dataset + first batch (64 x 2048), s | peak RSS |\n"
          "|---|---|---|")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for label, path in [("one file, first start (scans it, writes its index)", single),
                        ("one file, later starts (index cached)", single), ("100 shards", hundred)]:
        if label.startswith("one file, first"):
            for stale in glob.glob(single + ".index.npz"):
                os.remove(stale)
        _, rss, out = _measured([sys.executable, "-c", first, path], env={**os.environ, "PYTHONPATH": root})
        seconds = float(next(line for line in out.splitlines() if line.startswith("FIRST")).split()[1])
        print(f"| {label} | {seconds:.2f} | {rss:,.0f} MiB |", flush=True)


def device_configs(smoke: bool, devices: int) -> dict:
    """The device benchmark's models, bf16, FSDP over every device: a ~1B dense Llama (Llama 3.2 1B's
    shape: 16 layers, d_model 2048, GQA 32 / 8 heads, d_ff 8192, 128,256-token vocabulary) at 8 x 2048 tokens
    per device, and a small MoE (8 layers, 8 experts top-2, dropless ragged dispatch); `smoke`: tiny ones."""
    from parallax.defaults import default_config

    out = {}
    for name, model in (("llama-1b", "llama"), ("moe-small", "moe")):
        c = default_config(model=model)
        c.mesh.update(data=1, fsdp=devices)
        if model == "llama":
            c.model.update(num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, d_ff=8192, vocab_size=128256)
        else:
            c.model.update(num_layers=8, d_model=1024, num_heads=16, num_kv_heads=4, vocab_size=32768)
            c.model.moe.update(num_experts=8, top_k=2, d_ff_expert=2816, dispatch="ragged")
        c.model.update(dtype="bfloat16", remat="dots", attention_block=512, loss_chunk=1024)
        c.train.update(global_batch_size=8 * devices, seq_len=2048)
        if smoke:
            c.model.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, vocab_size=512, attention_block=32,
                           loss_chunk=32, **({"d_ff": 128} if model == "llama" else {}))
            if model == "moe":
                c.model.moe.update(d_ff_expert=64)
            c.train.update(global_batch_size=2 * devices, seq_len=64)
        c.data.source = "synthetic"
        out[name] = c
    return out


def bench_device(steps: int, smoke: bool):
    """Tokens/s per chip and MFU of `device_configs` on this machine's devices (one table row each)."""
    import jax

    from parallax.throughput import throughput
    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    devices = jax.devices()
    kind = devices[0].device_kind
    print(f"| model ({len(devices)} x {kind}, jax {jax.__version__}) | params | kernels | tokens/s/chip | "
          "step s | MFU | loss |\n|---|---|---|---|---|---|---|")
    for name, config in device_configs(smoke, len(devices)).items():
        trainer = Trainer(config, devices)
        dt, loss = _time_steps(trainer, make_dataset(config), steps)
        record = throughput(trainer.plan, trainer.mesh).metrics(dt)
        mfu = f"{100 * record['mfu']:.1f}%" if "mfu" in record else "n/a (peak unknown)"
        impl = trainer.plan.parallelism.attention_impl
        kernels = f"{impl} ({config.model.attention_block})" if config.model.attention_block else "reference"
        if config.model.get("moe") and config.model.moe.dispatch == "ragged":
            from parallax.parallel.expert import grouped_impl

            kernels += f"; grouped matmuls: {grouped_impl(config.model.moe.grouped_impl, trainer.plan.platform)}"
        print(f"| {name} | {trainer.num_params / 1e9:.3g}B | {kernels} | "
              f"{record['tokens_per_sec_per_device']:,.0f} | {dt:.3f} | {mfu} | {loss:.3f} |", flush=True)


def bench_generate():
    """Tokens/s of `parallax.generate` with and without the KV cache: the bench model (8 layers, d_model 128)
    with a 1,040-token window, a batch of 4 prompts of 16 tokens, greedy, 256 and 1,024 new tokens. Without
    the cache every token recomputes the whole padded window, so each costs the same: that rate is timed on
    the first 32 tokens (after a compile) rather than for an hour of CPU."""
    import time

    import jax

    from parallax.generate import generate
    from parallax.trainer import Trainer

    config = _config()
    config.train.seq_len = 1040
    trainer = Trainer(config, devices=jax.devices()[:1])
    params = trainer.init_state(0)["params"]
    prompts = [[(7 * r + i) % 256 for i in range(16)] for r in range(4)]

    def rate(new, cache):
        def run():
            return generate(trainer.graphdef, params, prompts, new, config.train.seq_len, cache=cache,
                            par=trainer.plan.parallelism)
        run() if cache else generate(trainer.graphdef, params, prompts, 1, config.train.seq_len, cache=False,
                                     par=trainer.plan.parallelism)  # compile
        start = time.perf_counter()
        outs = run()
        return sum(len(o) for o in outs) / (time.perf_counter() - start)

    print(f"jax {jax.__version__}, 1 {jax.devices()[0].platform} device; 8 layers, d_model 128, window 1,040, "
          f"4 prompts x 16 tokens, greedy\n")
    print("| new tokens | KV cache: tokens/s | no cache (window recomputed): tokens/s | speed-up |\n|---|---|---|---|",
          flush=True)
    window = rate(32, False)  # the same per token at any length (module doc)
    for new in (256, 1024):
        cached = rate(new, True)
        print(f"| {new} | {cached:,.0f} | {window:,.1f} | {cached / window:,.0f}x |", flush=True)


DILOCO_RUNS = (  # (label, mesh, diloco settings); the quickstart model and corpus, 4 devices
    ("data parallel (data=4)", dict(data=4), {}),
    ("DiLoCo R=4, H=10, fp32", dict(replica=4, data=1), dict(sync_every=10)),
    ("DiLoCo R=4, H=10, int8", dict(replica=4, data=1), dict(sync_every=10, pseudo_grad_dtype="int8")),
    ("DiLoCo R=4, H=50, fp32", dict(replica=4, data=1), dict(sync_every=50)),
    ("DiLoCo R=4, H=50, int8", dict(replica=4, data=1), dict(sync_every=50, pseudo_grad_dtype="int8")),
    ("Streaming R=4, H=50, F=4, overlap 1, fp32", dict(replica=4, data=1),
     dict(sync_every=50, fragments=4, overlap=1)),
)


def bench_diloco(steps: int):
    """DiLoCo against data parallelism at equal tokens: configs/quickstart.py (byte-level Llama on the stdlib
    corpus, 16 rows x 128 tokens a step) for `steps` steps on 4 devices, each run's final eval loss and the
    bytes one device sends over the replicas' link per step (the compiled sync's, over H)."""
    import tempfile
    import time

    from parallax.defaults import load_config_file
    from parallax.train import train_and_evaluate

    print(f"| run ({steps} steps, 16 x 128 tokens a step) | final eval loss | last train loss | time |\n"
          "|---|---|---|---|",
          flush=True)
    for label, mesh, diloco in DILOCO_RUNS:
        config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                               "quickstart.py"))
        for axis in config.mesh:
            config.mesh[axis] = mesh.get(axis, 1)
        config.diloco.update(diloco)
        config.train.update(steps=steps, eval_every=steps, checkpoint_every=0, log_every=steps, eval_batches=8)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as workdir:
            result = train_and_evaluate(config, workdir, log=lambda *_: None)
        print(f"| {label} | {result.eval_loss:.4f} | {result.history[-1]['loss']:.4f} | "
              f"{time.perf_counter() - start:.0f} s |", flush=True)


def bench_quant(steps: int):
    """8-bit training against the unquantized run at equal steps, each run's final eval loss and its ratio to
    the first mode's (docs/quantization.md's convergence tables). `--quant_model=quickstart`: configs/quickstart.py
    (byte-level Llama on the stdlib corpus, its mesh); `bpe`: 8 layers x d_model 256 (8.4M parameters) on a
    BPE of 4,096 ids trained on the standard library's modules, shards prepared once (data.md's recipe).
    `--dtype`: the compute dtype (bf16 is emulated on a CPU: the same roundings, not the speed)."""
    import glob
    import tempfile
    import time

    from parallax.defaults import load_config_file
    from parallax.train import train_and_evaluate

    modes = FLAGS.modes.split(",")
    print(f"| quant.mode ({FLAGS.quant_model}, {steps} steps, {FLAGS.dtype} compute) | final eval loss | "
          f"vs {modes[0]} | last train loss | time |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        shards = ""
        if FLAGS.quant_model == "bpe":
            from parallax.prepare import iter_texts, prepare
            from parallax.tokenizer import train_bpe
            stdlib = os.path.dirname(os.__file__)
            inputs = [f"lib={stdlib}/*.py", f"email={stdlib}/email/*.py"]
            train_bpe(iter_texts([f"{stdlib}/*.py"], "text", 0), 4096, os.path.join(scratch, "bpe"),
                      show_progress=False)
            shards = os.path.join(scratch, "shards")
            prepare(inputs, shards, os.path.join(scratch, "bpe"), progress=False, log=lambda *_: None)
            assert glob.glob(os.path.join(shards, "*"))
        base = None
        for mode in modes:
            config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                                   "quickstart.py"))
            if shards:
                config.model.update(num_layers=8, d_model=256, num_heads=8, num_kv_heads=4, d_ff=768, vocab_size=0)
                config.data.update(source="tokens", path=shards, mixture="lib=0.8,email=0.2")
            config.model.dtype = FLAGS.dtype
            config.quant.update(mode=mode, block=32)
            config.train.update(steps=steps, eval_every=steps, checkpoint_every=0, log_every=steps, eval_batches=8)
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as workdir:
                result = train_and_evaluate(config, workdir, log=lambda *_: None)
            base = result.eval_loss if base is None else base
            print(f"| {mode} | {result.eval_loss:.4f} | {100 * (result.eval_loss / base - 1):+.2f}% | "
                  f"{result.history[-1]['loss']:.4f} | {time.perf_counter() - start:.0f} s |", flush=True)


# The TPU compiler turns all-to-alls into async start / done pairs only with this flag (MaxText sets it for MoE).
ASYNC_ALL_TO_ALL = "--xla_tpu_enable_async_all_to_all=true"


def bench_overlap(topology: str):
    """A MoE model at expert 2 x pipe 2 compiled by the TPU compiler (libtpu, ahead of time) under zbv and
    dualpipev: the async all-to-alls of the scheduled program and what runs between each start and done
    (`parallax.hlo.collective_windows`): in dualpipev's paired branches, the compute of the other microbatch."""

    from parallax import hlo
    from parallax.defaults import load_config_file
    from parallax.memory import compile_step, tpu_devices

    devices = tpu_devices(topology)
    print(f"{len(devices)} x {devices[0].device_kind} ({topology}), LIBTPU_INIT_ARGS="
          f"{os.environ.get('LIBTPU_INIT_ARGS', '')!r}\n")
    print("| schedule | async all-to-alls | with compute inside | of the forward beside a backward: enclosing "
          "the other microbatch's compute (ops) | of the backward beside a forward: idem | sum of buffers GiB |")
    print("|---|---|---|---|---|---|")
    for schedule in OVERLAP_SCHEDULES:
        config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                               "moe_tiny.py"))
        config.mesh.update(pipe=2, expert=2)
        config.pipeline.update(schedule=schedule, virtual_stages=2, microbatches=4)
        config.model.update(num_layers=4, d_model=1024, num_heads=8, num_kv_heads=8, vocab_size=32000,
                            attention_block=512, loss_chunk=512)
        config.model.moe.d_ff_expert = 2048
        config.train.update(seq_len=2048, global_batch_size=8)
        _, compiled = compile_step(config, devices)
        windows = hlo.collective_windows(compiled.as_text())
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes

        def lane(k):
            mine = [w for w in windows if w["lane"] == k]
            return f"{sum(w['other'] > 0 for w in mine)} of {len(mine)} ({sum(w['other'] for w in mine)})"
        print(f"| {schedule} | {len(windows)} | {sum(w['compute'] > 0 for w in windows)} | {lane(0)} | {lane(1)} | "
              f"{total / 2**30:.2f} |")


def bench_packs(rows: int = 16, seq_len: int = 131072, block: int = 512):
    """Per-rank causal attention work (sum of position + 1 over each rank's tokens) on packed rows of
    documents with log-normal lengths, over seq 4 and 8: the zigzag layout against `seq_layout=balanced`
    (`sequence.balanced_order`, one piece per attention tile). Numpy and one jitted order per case."""
    import numpy as np

    from parallax.parallel import sequence

    print(f"{rows} packed rows of {seq_len} tokens; max / mean per-rank work (1.00 = even)\n")
    print("| documents (log-normal) | seq | zigzag | balanced |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    for median, sigma in ((2000, 1.2), (8000, 1.0)):
        seg, pos = np.zeros((rows, seq_len), np.int32), np.zeros((rows, seq_len), np.int32)
        for r in range(rows):
            start, doc = -int(rng.integers(0, median)), 1  # the first document starts before the row
            while start < seq_len:
                n = max(1, int(rng.lognormal(np.log(median), sigma)))
                lo, hi = max(start, 0), min(start + n, seq_len)
                if hi > lo:
                    seg[r, lo:hi], pos[r, lo:hi] = doc, np.arange(lo - start, hi - start)
                start, doc = start + n, doc + 1
        for s in (4, 8):
            zigzag = sequence.ring_layout(np.broadcast_to(np.arange(seq_len), seg.shape), s, axis=1)
            balanced = sequence.balanced_order(seg, pos, s, sequence.balanced_chunks(seq_len // s, block))

            def spread(order):
                work = sequence.attention_work(seg, pos, order, s)
                return work.max() / work.mean()
            print(f"| median {median}, sigma {sigma} | {s} | {spread(zigzag):.3f} | {spread(balanced):.3f} |")


def bench_split():
    """docs/pipeline.md's split-backward table: the matmul FLOPs of one step (`parallax.pipeline.work`, on the
    traced step: nothing compiled) of configs/tiny.py's Llama at 8 layers, batch 32 x 32, 8 microbatches,
    per device summed over the pipeline ranks, and of one B, W and fused BW action."""
    import jax

    from parallax.defaults import load_config_file
    from parallax.pipeline import work
    from parallax.pipeline.program import compile_schedule
    from parallax.plan import abstract_batch
    from parallax.trainer import Trainer

    print("| mesh | schedule | GFLOP | B / W / BW per action, MFLOP |\n|---|---|---|---|")
    for label, mesh in (("pipe 2 x tensor 2 x fsdp 2", dict(pipe=2, tensor=2, fsdp=2)), ("pipe 4 x data 2",
                                                                                        dict(pipe=4, data=2))):
        for schedule in ("1f1b", "zb_h1", "zbv"):
            config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                                   "tiny.py"))
            for axis in config.mesh:
                config.mesh[axis] = mesh.get(axis, 1)
            config.model.num_layers = 8
            config.train.global_batch_size = 32
            config.pipeline.update(schedule=schedule, microbatches=8, virtual_stages=KINDS[schedule].virtual_stages(2))
            trainer = Trainer(config, devices=jax.devices()[:8])
            batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in abstract_batch(config).items()}
            flops = work.step_flops(jax.make_jaxpr(trainer.loss_and_grads)(trainer.abstract_params, batch),
                                    compile_schedule(trainer.plan.schedule))
            actions = " / ".join(f"{flops[k] / 1e6:.2f}" if k in flops else "-" for k in ("B", "W", "BW"))
            print(f"| {label} | {schedule} | {flops['total'] / 1e9:.3f} | {actions} |", flush=True)


# docs/memory.md's measured configs: (row, config file, overrides, devices), XLA:CPU's compiled peak per device.
MEMORY_ROWS = [
    ("`llama3_8b.py`: 32 microbatches of 1 x 8192 per GPU, remat full", "llama3_8b.py", {}, 8),
    ("`llama3_70b.py`: 64 microbatches, remat full", "llama3_70b.py", {}, 64),
    ("`llama3_70b_pp.py`: zb_h1, 64 microbatches", "llama3_70b_pp.py", {}, 64),
    ("`gpt2_small.py` (5 microbatches)", "gpt2_small.py", {}, 8),
    ("`gpt2_small.py` without accumulation", "gpt2_small.py", {"train.microbatches": "1"}, 8),
]


def bench_memory():
    """docs/memory.md's table of measured configs, regenerated: each config's train step compiled for its
    simulated CPU devices (`parallax.memory.memory_report`, what `launch/plan.py` prints), the peak per
    device and whether it fits an 80 GB GPU (74.5 GiB)."""
    import jax

    from parallax.config import apply_override
    from parallax.defaults import load_config_file
    from parallax.memory import memory_report

    print(f"jax {jax.__version__}, XLA:CPU, per device, bf16\n")
    print("| config | devices / mesh | peak | fits 80 GB |")
    print("|---|---|---|---|")
    for row, name, overrides, n in MEMORY_ROWS:
        if n > len(jax.devices()):
            print(f"| {row} | {n}: needs --cpu_devices={n} | | |")
            continue
        config = load_config_file(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                               "configs", name))
        for key, value in overrides.items():
            apply_override(config, key, value)
        start = time.perf_counter()
        report = memory_report(config, jax.devices()[:n])
        peak = report.peak / 2**30
        rest = n // math.prod(v for v in config.mesh.values() if v > 0)  # what an axis of -1 takes
        sizes = {a: rest if v == -1 else v for a, v in config.mesh.items()}
        mesh = ", ".join(f"{a} {v}" for a, v in sizes.items() if v != 1)
        print(f"| {row} | {n}: {mesh} | {peak:.1f} GiB | {'yes' if peak <= 74.5 else 'no'} |   "
              f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)


def main(_):
    if FLAGS.part == "device" and not FLAGS.cpu_devices:  # the overlap flags a training run would set
        from parallax.mesh import apply_platform_flags, detect_platform

        print("platform flags:", apply_platform_flags(detect_platform()))
    if FLAGS.part == "overlap":  # the TPU compiler's flags, set before libtpu starts
        from parallax.mesh import apply_platform_flags

        os.environ["LIBTPU_INIT_ARGS"] = " ".join([os.environ.get("LIBTPU_INIT_ARGS", ""), ASYNC_ALL_TO_ALL]).strip()
        apply_platform_flags("tpu", generation=FLAGS.topology.split(":")[0])
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        bench_overlap(FLAGS.topology)
        return
    if FLAGS.part == "packs":
        bench_packs()
        return
    if FLAGS.part == "data":  # no jax: the data pipeline alone
        bench_data(FLAGS.data_gb, FLAGS.data_dir)
        return
    if FLAGS.cpu_devices:
        from parallax.mesh import simulate_cpu_devices

        simulate_cpu_devices(FLAGS.cpu_devices)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    import jax

    if FLAGS.part == "quant":
        return bench_quant(FLAGS.steps)
    if FLAGS.part == "diloco":
        bench_diloco(FLAGS.steps)
        return
    if FLAGS.part not in ("device", "generate", "balance", "memory", "split"):
        print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices; model: 8 layers, "
              f"d_model 128, batch 16 x 128 tokens (pipeline: 2 rows per microbatch per data shard)\n")
    if FLAGS.part in ("all", "mesh"):
        bench_meshes(FLAGS.steps)
    if FLAGS.part == "rank":
        bench_rank(FLAGS.steps)
    if FLAGS.part in ("all", "pipeline"):
        bench_pipeline(FLAGS.steps, FLAGS.schedules)
    if FLAGS.part == "balance":
        bench_balance()
    if FLAGS.part == "muon":
        bench_muon()
    if FLAGS.part == "device":
        bench_device(2 if FLAGS.smoke else FLAGS.steps, FLAGS.smoke)
    if FLAGS.part == "generate":
        bench_generate()
    if FLAGS.part == "memory":
        bench_memory()
    if FLAGS.part == "split":
        bench_split()



def cli():
    """The `parallax-bench` console script (pyproject.toml); also `python launch/bench.py`."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
