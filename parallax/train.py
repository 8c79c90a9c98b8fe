"""The training loop: data, eval, logging, metrics, checkpoints and preemption around the jitted steps.

`train_and_evaluate(config, workdir)` is the library entry point (the launcher calls it): it makes the
plan and the `Trainer` (`parallax.trainer`), resumes from the workdir's latest checkpoint, trains with a
progress line, `metrics.jsonl` and TensorBoard event files (`tb/`), evaluates every `train.eval_every` steps
by the training loss path, saves every `train.checkpoint_every` steps, and on SIGTERM or SIGINT (Ctrl-C)
saves and returns. `train.profile_steps=(a, b)` writes a `jax.profiler` trace of steps a..b to `profile/`
(TensorBoard's profile plugin, Perfetto).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import shutil
import signal
import time

import jax
import numpy as np
from etils import epath

from parallax import checkpoint as ckpt_lib
from parallax import data as data_lib
from parallax import lora
from parallax import mesh as mesh_lib
from parallax import remote
from parallax import dpo_settings, optim, preference
from parallax import steps
from parallax import corpus as shard_lib
from parallax import tokenizer as tok_lib
from parallax.defaults import load_saved_config
from parallax.errors import ConfigError
from parallax.goodput import FILE as GOODPUT_FILE, Goodput
from parallax.hang import HangWatch
from parallax.summary import Sinks, TensorBoardWriter, WandbWriter
from parallax.throughput import throughput
from parallax.trainer import Trainer


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); the message says what to change."""


@dataclasses.dataclass
class TrainResult:
    history: list  # one metrics dict per logged step
    eval_loss: float | None
    state: dict
    trainer: Trainer
    preempted: bool = False
    stop_signal: int = 0  # the signal that stopped it (SIGTERM, SIGINT); 0 for none or a preemption notice
    goodput: dict | None = None  # seconds per bucket over every attempt of the workdir (`parallax.goodput`)


def _shard_dirs(config) -> list[str]:
    d = config.data
    dirs = [p.strip() for p in str(d.path).split(",") if p.strip()]
    return dirs if d.source == "tokens" and dirs and all(os.path.isdir(p) for p in dirs) else []


def run_tokenizer(config):
    """The run's tokenizer (`parallax.tokenizer`), or None for id-only corpora (synthetic, a raw token file
    without `data.tokenizer`): `data.tokenizer` if set, else a shard directory's own copy, else bytes for
    `text`."""
    d = config.data
    spec = str(d.tokenizer)
    if d.source == "synthetic":
        if spec:
            raise ConfigError(f"config.data.tokenizer={spec!r}: source='synthetic' makes token ids, not text; "
                              "drop the tokenizer, or train on text (source='text' or 'tokens')")
        return None
    if d.source == "text":
        if spec not in ("", "bytes"):
            raise ConfigError(f"config.data.tokenizer={spec!r}: source='text' trains on bytes; to train with this "
                              "tokenizer, prepare the files into shards (launch/prepare_data.py --tokenizer=...) and "
                              "set source='tokens', path=THAT_DIR")
        return tok_lib.ByteTokenizer(None if d.eos_id < 0 else int(d.eos_id))
    dirs = _shard_dirs(config)
    if dirs:
        try:  # not a shard directory: that is the error to show, not a missing DIR/tokenizer
            shard_lib.read_manifest(dirs[0])
        except shard_lib.ShardError as e:
            raise ConfigError(f"config.data.path={d.path!r}: {e}") from None
    if not spec and dirs:
        spec = os.path.join(dirs[0], "tokenizer")
    if spec == "bytes":  # as prepare_data.py writes bytes: eos 256 unless set
        return tok_lib.ByteTokenizer(256 if d.eos_id < 0 else int(d.eos_id))
    return tok_lib.load(spec, None if d.eos_id < 0 else int(d.eos_id)) if spec else None


def resolve_data(config):
    """`config` with the keys the tokenizer decides filled in: `data.eos_id` (from -1) and `model.vocab_size`
    (from 0: the tokenizer's ids rounded up to a multiple of 128); a value that disagrees
    with the tokenizer is a one-line ConfigError. Returns (config, tokenizer or None); `config` is a copy."""
    config = copy.deepcopy(config)
    config.data.path = remote.localize_paths(config.data.path, "config.data.path")  # a bucket's: a local copy
    tok = run_tokenizer(config)
    d, m = config.data, config.model
    if tok is None:
        if int(m.vocab_size) == 0:
            _check_tokens_path(d)  # a mistyped path, not the tokenizer it would have held, is the thing to fix
            raise ConfigError("config.model.vocab_size=0 (from the tokenizer), but this corpus has none; set "
                              "data.tokenizer or model.vocab_size")
        return config, None
    if tok.eos_id is not None:
        if d.eos_id < 0:
            d.eos_id = tok.eos_id
        elif int(d.eos_id) != tok.eos_id:
            raise ConfigError(f"config.data.eos_id={d.eos_id}: the tokenizer's eos is {tok.eos_id}; drop the "
                              "override (-1 takes the tokenizer's)")
    multiple = 128  # not of the mesh: a resume on another mesh must pad the same (mesh checks divisibility)
    if int(m.vocab_size) == 0:
        m.vocab_size = tok_lib.padded_vocab(tok.vocab_size, multiple)
    elif int(m.vocab_size) < tok.vocab_size:
        raise ConfigError(f"config.model.vocab_size={m.vocab_size}: the tokenizer ({tok.describe()}) emits ids up "
                          f"to {tok.vocab_size - 1}; set model.vocab_size="
                          f"{tok_lib.padded_vocab(tok.vocab_size, multiple)} (or 0: from the tokenizer)")
    return config, tok


def _check_tokens_path(d) -> None:
    """source='tokens': every path of `data.path` exists, else a ConfigError naming `config.data.path`."""
    if d.source == "tokens":
        try:
            data_lib.check_token_paths(d.path)
        except data_lib.DataError as e:
            raise ConfigError(f"config.data.{e}") from None


def make_dataset(config, tokenizer=None) -> data_lib.Dataset:
    d, t = config.data, config.train
    if d.source == "preference":  # DPO pairs, tokenized now: a bad row stops the run before anything is written
        dataset = preference.make_dataset(
            d.path, tokenizer, dpo_settings.resolve(config.dpo, {}, False), seq_len=t.seq_len,
            global_batch_size=t.global_batch_size, seed=t.seed, eval_fraction=d.eval_fraction, sampler=d.sampler)
        if t.eval_every and dataset.streams["eval"] is None:
            raise ConfigError(f"config.data.eval_fraction={d.eval_fraction}: {d.path} has no eval pairs; raise "
                              "eval_fraction or set train.eval_every=0")
        return dataset
    _check_tokens_path(d)
    try:
        dataset = data_lib.make_dataset(
            d.source, d.path, seq_len=t.seq_len, global_batch_size=t.global_batch_size, seed=t.seed,
            vocab_size=config.model.vocab_size, eval_fraction=d.eval_fraction,
            eos_id=None if d.eos_id < 0 else d.eos_id, sampler=d.sampler, mixture=d.mixture,
            tokenizer_hash=tokenizer.hash if tokenizer is not None and _shard_dirs(config) else None)
    except data_lib.DataError as e:
        raise ConfigError(f"config.data: {e}") from None
    if t.eval_every and dataset.streams["eval"] is None:
        raise ConfigError(f"config.data.eval_fraction={d.eval_fraction}: the corpus at {d.path or 'the default'} "
                          f"has no eval documents; raise eval_fraction or set train.eval_every=0")
    if t.eval_every and len(dataset.streams["eval"]) < t.seq_len + 1:  # eval would be mostly padding
        raise ConfigError(f"config.data.eval_fraction={d.eval_fraction}: the corpus at {d.path or 'the default'} "
                          f"has {len(dataset.streams['eval'])} eval tokens, fewer than train.seq_len + 1 = "
                          f"{t.seq_len + 1}; raise eval_fraction, lower seq_len or set train.eval_every=0")
    return dataset


def evaluate(trainer: Trainer, params, dataset, num_batches: int, source: str | None = None) -> float:
    """Mean token loss over the first `num_batches` batches of the eval split (of one mixture `source`)."""
    total = np.zeros(2)
    for i in range(num_batches):
        batch = trainer.device_batch(dataset.batch(i, "eval", rows=trainer.host_rows(), source=source))
        total += np.asarray(trainer.eval_step(params, batch))
    return float(total[0] / max(total[1], 1.0))


_MUST_MATCH_ON_RESUME = ("model", "data", "optim", "train.seed", "train.global_batch_size", "train.seq_len",
                         "train.spike_policy")  # the state's tree: its running statistics
# Memory knobs that do not change the math (blockwise attention and the chunked loss are exact).
_MAY_CHANGE_ON_RESUME = ("model.attention_block", "model.loss_chunk", "model.attention_impl", "optim.offload_state",
                         "model.seq_layout", "model.ulysses_degree",
                         "data.tokenizer")  # where it lives may change; what it is (its hash) may not: _start


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
    return out


def check_resume(config, saved_json: str) -> None:
    """Raises ConfigError if `config` changes a key that an exact resume depends on (vs the saved config).

    The mesh, the pipeline, logging keys and the memory knobs `model.attention_block` / `model.loss_chunk`
    may change (unless a step path's state depends on them: `StepPath.check_resume`); the rest of the
    model, data, optimizer, seed, batch and sequence length may not. The LR
    schedule's horizon (`optim.decay_steps`, or `train.steps` when it is 0) may not change either, but how it
    is spelled may: a run of `train.steps=3` with `decay_steps=0` continues with `decay_steps=3` and any
    `train.steps` -- the fix the refusal suggests.
    """
    saved = _flatten(json.loads(saved_json))
    if "model.name" in saved:  # keys added since the checkpoint was written compare as their defaults
        saved = _flatten(json.loads(load_saved_config(saved_json).to_json_best_effort()))
    now = _flatten(json.loads(config.to_json_best_effort()))
    keys = [k for k in now if (k.startswith(tuple(p + "." for p in ("model", "data", "optim")))
                               or k in _MUST_MATCH_ON_RESUME) and k not in _MAY_CHANGE_ON_RESUME]
    if "model.name" not in saved:
        raise ConfigError("config.model.name: the checkpoint in this workdir was written before models were named "
                          "in the config (and with other parameter names); use a new --workdir")
    for key in keys:
        if key != "optim.decay_steps" and key in saved and saved[key] != now[key]:
            raise ConfigError(f"config.{key}={now[key]!r}: the checkpoint in this workdir was trained with "
                              f"{saved[key]!r}, so resuming would not continue the same run; use a new --workdir "
                              "to start a different run")
    lora.check_resume(saved, now)  # the adapters are part of the state's tree
    steps.check_resume(saved, now)  # each step path's own rules (`StepPath.check_resume`)
    if "train.steps" in saved and "optim.decay_steps" in saved:
        horizon = saved["optim.decay_steps"] or saved["train.steps"]  # lr_schedule's: decay_steps or train.steps
        if (now["optim.decay_steps"] or now["train.steps"]) != horizon:
            key = "optim.decay_steps" if now["optim.decay_steps"] else "train.steps"
            raise ConfigError(f"config.{key}={now[key]!r}: the checkpoint in this workdir was trained with {horizon} "
                              f"as the LR schedule's length (train.steps={saved['train.steps']}, optim.decay_steps="
                              f"{saved['optim.decay_steps']}), so resuming would not continue the same run; set "
                              f"optim.decay_steps={horizon} to extend the run with the same LR schedule")


def _stop_signal(signum: int, request: int = 0) -> tuple[int, int]:
    """(the stop signal any host received (the largest number, so SIGTERM wins over SIGINT), the rewind
    request any host read (`_RewindRequests.poll`)), the same on every host: hosts must stop, and rewind,
    at the same step. 0: none. One collective for both."""
    if jax.process_count() == 1:
        return signum, request
    from jax.experimental import multihost_utils
    agreed = np.asarray(multihost_utils.process_allgather(np.array([signum, request], np.int32))).reshape(-1, 2)
    return int(agreed[:, 0].max()), int(agreed[:, 1].max())


REWIND_FILE = "REWIND"


class _RewindRequests:
    """A rewind on request: an operator writes `WORKDIR/REWIND` (empty: back to the newest checkpoint; a
    step N: to the newest checkpoint at or before N), and after the step in progress every process restores
    it, keeping the step count (the batches in between are skipped, as after a spike rewind). The file is
    then renamed `REWIND.done` (`.rejected` if it does not hold a step). `poll` encodes a request for the
    hosts' agreement: 0 none, 1 the newest checkpoint, N + 2 the newest at or before N."""

    def __init__(self, path, lead: bool, log):
        self.path, self.lead, self.log, self.seen = path, lead, log, None

    def poll(self) -> int:
        if self.path is None:
            return 0
        try:
            stat = os.stat(str(self.path))
            text = epath.Path(self.path).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return 0
        if (stat.st_mtime_ns, stat.st_size) == self.seen:  # handled (another host may not have renamed it yet)
            return 0
        self.seen = (stat.st_mtime_ns, stat.st_size)
        if not text:
            return 1
        if text.isdigit():
            return int(text) + 2
        self.log(f"{self.path}: {text[:40]!r} is not a step; write a step number (the newest checkpoint at or "
                 "before it) or nothing (the newest checkpoint); ignored")
        self._retire(".rejected")
        return 0

    def done(self) -> None:
        self._retire(".done")

    def _retire(self, suffix) -> None:
        if self.lead:
            try:
                os.replace(str(self.path), str(self.path) + suffix)
            except FileNotFoundError:
                pass


class _StopSignals:
    """From creation to `restore()`, SIGTERM and SIGINT are recorded (`self.signum`) instead of stopping the
    process, so the loop saves at the end of the step and returns. A second SIGINT raises KeyboardInterrupt
    at once (the default handler again): Ctrl-C twice aborts without waiting for the save."""

    def __init__(self):
        self.signum, self.previous = 0, {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, self.record)

    def record(self, signum, frame):
        del frame
        self.signum = max(self.signum, signum)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def train_and_evaluate(config, workdir: str, devices=None, log=print, started: float | None = None) -> TrainResult:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; the library entry point.

    Only process 0 writes `config.json`, `metrics.jsonl` and the TensorBoard events (`tb/`) and logs. On
    SIGTERM or SIGINT every host saves the same step and returns with `preempted=True` (and `stop_signal`);
    rerunning the same command continues exactly. A second SIGINT raises KeyboardInterrupt without saving.
    `started`: when this attempt began for the goodput accounts (`time.time()`; the launcher passes its
    process's start), else now.
    """
    entered = time.time()
    if remote.is_remote(workdir):  # run from a local copy that a thread uploads (parallax/remote.py)
        mirror = remote.Mirror(str(workdir))
        mirror.pull(log if jax.process_index() == 0 else None)
        mirror.start()
        try:
            return train_and_evaluate(config, mirror.local, devices, log, started=entered if started is None else started)
        finally:
            mirror.close()
    config, tokenizer = resolve_data(config)
    trainer = Trainer(config, devices)
    dataset = make_dataset(config, tokenizer)
    t = trainer.plan.train  # the typed settings the loop reads
    lead = jax.process_index() == 0
    log = log if lead else (lambda *_: None)
    workdir = epath.Path(workdir)
    local = None if not t.local_checkpoint_every else ckpt_lib.LocalTier(
        t.local_checkpoint_dir or workdir / "local", t.local_checkpoint_every, t.local_checkpoint_keep,
        trainer.abstract_state())
    checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", t.checkpoint_every, t.keep_checkpoints,
                                         async_save=t.async_checkpoint, local=local)
    sinks, profiler = None, _Profiler(workdir / "profile", t.profile_steps)
    close, stop, began_training = True, _StopSignals(), False
    goodput = Goodput(workdir / GOODPUT_FILE if lead else None, start=entered if started is None else started)
    watch = HangWatch(workdir / "hang", t.hang_timeout_s, t.hang_factor, jax.process_index(), jax.process_count())
    try:
        state = _start(trainer, dataset, checkpointer, workdir, lead, log, tokenizer, goodput)
        if isinstance(dataset, preference.PreferenceDataset):
            set_reference(trainer, dataset, state, workdir, lead, log)
        if lead:
            sinks = Sinks([TensorBoardWriter(workdir / "tb", int(state["step"]))])
            if t.wandb_project:
                sinks.sinks.append(WandbWriter(workdir, t.wandb_project, t.wandb_entity, t.wandb_mode,
                                                     config.to_dict()))
        goodput.add("startup", time.time() - goodput.start - sum(goodput.now.values()))
        began_training = True  # from here on the accounts are written (a refused run leaves the workdir as it was)
        watch.start()
        result = _loop(trainer, dataset, checkpointer, state, workdir / "metrics.jsonl" if lead else None, log,
                       lambda: stop.signum, sinks, profiler, goodput, watch,
                       _RewindRequests(workdir / REWIND_FILE, lead, log))
        watch.stop()
        began = time.perf_counter()
        close = False
        checkpointer.close()  # waits for the last async save: a first Ctrl-C here is only recorded
        goodput.add("checkpoint", time.perf_counter() - began)
        goodput.saved_all()
        result.goodput = goodput.buckets()
        log(goodput.line())
        if result.preempted:  # last: what to do next
            log(f"received {signal.Signals(result.stop_signal).name if result.stop_signal else 'a preemption notice'}"
                f": saved step {int(result.state['step'])}; rerun the same command to continue")
        return result
    except BaseException as e:
        # With several processes, an error is most often a lost peer: closing would wait on a save whose
        # commit needs every process; a second Ctrl-C asks not to wait. The last complete checkpoint is on
        # disk either way.
        close = jax.process_count() == 1 and not isinstance(e, KeyboardInterrupt)
        raise
    finally:
        watch.stop()
        if began_training:
            goodput.persist(force=True)
        profiler.stop()
        if sinks is not None:
            sinks.close()  # flushes what was logged, also when the run failed
        try:
            if close:
                checkpointer.close()  # waits for the last async save: a first Ctrl-C here is only recorded
        finally:
            stop.restore()


class _Profiler:
    """`jax.profiler` trace of steps first..last (`train.profile_steps`, 1-based like the logged steps) into
    `directory`; a resumed run past `first` traces the steps of the range it still runs."""

    def __init__(self, directory, steps):
        self.directory, self.steps, self.active = directory, tuple(steps), False

    def before(self, step: int) -> None:  # `step`: the number of the step about to run
        if self.steps and not self.active and self.steps[0] <= step <= self.steps[1]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int) -> None:  # `step` has finished (its metrics are on the host)
        if self.active and step >= self.steps[1]:
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


def check_workdir(config, workdir, start, tokenizer=None) -> None:
    """Raises ConfigError (one line) if `config` cannot train in `workdir` whose latest checkpoint is step
    `start` (None: none): a tokenizer other than the run's, checkpoints without config.json, a config that
    does not continue the saved one. Reads only: `_start` and `parallax.memory.dry_run` both call it."""
    workdir = epath.Path(workdir)
    config_path = workdir / "config.json"
    kept = tok_lib.read_meta(str(workdir / "tokenizer"))
    if start is not None and tokenizer is not None and kept is not None and kept["hash"] != tokenizer.hash:
        raise ConfigError(f"config.data.tokenizer={config.data.tokenizer!r}: {tokenizer.describe()} is not the "
                          f"tokenizer this run was trained with ({kept['kind']}, hash {kept['hash'][:12]}, kept in "
                          f"{workdir / 'tokenizer'}); train with data.tokenizer={workdir / 'tokenizer'} on a corpus "
                          "it tokenized, or use a new --workdir")
    if start is None:
        return  # a new run (a config.json without checkpoints is a run killed before its first: replaced)
    if not config_path.exists():
        raise ConfigError(f"--workdir={workdir}: has checkpoints (latest step {start}) but no config.json, so "
                          "this config cannot be checked against the run that wrote them; put that run's "
                          "config.json back, or use a new --workdir")
    try:
        check_resume(config, config_path.read_text())
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{config_path}: not a parallax config ({type(e).__name__}: {e}); put back the "
                          "config.json of the run that wrote the checkpoints, or use a new --workdir") from None


def _start(trainer, dataset, checkpointer, workdir, lead, log, tokenizer=None, goodput=None):
    """The state to train from: restored from the latest checkpoint (after checking that the config
    continues the same run), or freshly initialised (writing `config.json`). A workdir that cannot be resumed
    (checkpoints without config.json, an unreadable checkpoint) is a ConfigError before anything is written."""
    config = trainer.config
    start = checkpointer.latest_step()
    config_path = workdir / "config.json"
    kept = tok_lib.read_meta(str(workdir / "tokenizer"))
    check_workdir(config, workdir, start, tokenizer)
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        if start is None:
            config_path.write_text(config.to_json_best_effort(indent=2))
        if start is None and kept is not None:  # a run killed before its first checkpoint left one
            shutil.rmtree(workdir / "tokenizer")
            kept = None
        if tokenizer is not None and kept is None:  # the run's copy: sampling and export read it
            tokenizer.copy_to(str(workdir / "tokenizer"))
    log(f"parallax: {mesh_lib.describe(trainer.mesh, trainer.plan.dcn)}; model {config.model.name} "
        f"{trainer.num_params / 1e6:.2f}M params; {dataset.describe()}")
    log(f"throughput: {throughput(trainer.plan, trainer.mesh).describe()}")
    for line in optim.schedule_warnings(trainer.plan.optim, config.train.steps):
        log(line)
    if start is None:
        state = trainer.init_state()
    else:
        abstract = trainer.abstract_state()
        if trainer.path.state_keys:  # its state may be laid out for one mesh
            trainer.path.check_restore(checkpointer.saved_tree(start), abstract)
        began = time.perf_counter()
        state = checkpointer.restore(abstract, start)  # straight onto the mesh's shardings
        if goodput is not None:
            goodput.add("checkpoint", time.perf_counter() - began)
        log(f"resumed from {checkpointer.where(start)} at step {start}")
    if goodput is not None:
        goodput.restored(start or 0)
    if lead:  # only once the state is in hand: a refused resume leaves the workdir as it was
        _truncate_metrics(workdir / "metrics.jsonl", start or 0)
    return state


REFERENCE_FILE = "reference_logps.npz"


def reference_logps(trainer, dataset, params, split: str) -> np.ndarray:
    """[pairs, 2]: the log-prob sums of `split`'s chosen and rejected responses under `params` (forward only,
    on the run's mesh and step path), in file order, a global batch at a time (the last one padded)."""
    from parallax.steps import dpo

    fn = jax.jit(lambda p, b: dpo.response_logps(trainer.path, p, b),
                 out_shardings=jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec()))
    n, size = len(dataset.pairs[split]), trainer.plan.train.global_batch_size
    lo, hi = trainer.host_rows()
    out = []
    for start in range(0, n, size):
        indices = [i if i < n else -1 for i in range(start + lo, start + hi)]
        batch = trainer.device_batch(dataset.rows(split, indices, with_reference=False))
        out.append(np.asarray(jax.device_get(fn(params, batch)))[:n - start])
    return np.concatenate(out)


def set_reference(trainer, dataset, state, workdir, lead, log) -> None:
    """Gives `dataset` the reference's sums: computed from the starting parameters at step 0 (TRL's
    precompute_ref_log_probs; with LoRA the start is the base model) and kept in `WORKDIR/reference_logps.npz`
    for the resumes, which read it back (checked against the pairs' fingerprint)."""
    path = workdir / REFERENCE_FILE
    if int(state["step"]) > 0:
        try:
            with path.open("rb") as f:
                stored = dict(np.load(f))
        except FileNotFoundError:
            raise ConfigError(f"--workdir={workdir}: a DPO run past step 0 without {REFERENCE_FILE} (the reference "
                              "log-probs of its starting model); put it back, or start a new --workdir") from None
        if str(stored["fingerprint"]) != dataset.fingerprint:
            raise ConfigError(f"{path}: computed on other preference pairs than config.data.path="
                              f"{dataset.path!r} gives; train on the pairs this run started with, or use a new "
                              "--workdir")
        for split in preference.SPLITS:
            dataset.set_reference(split, stored[split])
        return
    t0 = time.perf_counter()
    sums = {split: reference_logps(trainer, dataset, state["params"], split) if dataset.pairs[split]
            else np.zeros((0, 2), np.float32) for split in preference.SPLITS}
    for split in preference.SPLITS:
        dataset.set_reference(split, sums[split])
    if lead:
        tmp = workdir / (REFERENCE_FILE + ".tmp")
        with tmp.open("wb") as f:
            np.savez(f, fingerprint=np.asarray(dataset.fingerprint), **sums)
        tmp.replace(path)
    log(f"dpo: reference log-probs of {len(sums['train'])} train and {len(sums['eval'])} eval pairs from the "
        f"starting model in {time.perf_counter() - t0:.1f}s ({path})")


def _truncate_metrics(path, step: int) -> None:
    """Drops the lines of steps after `step` (the checkpoint resumed from) that a killed run had logged, and
    any torn last line, so the rerun's lines do not repeat them; rewritten atomically (temp file + rename)."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            if int(record["step"]) <= step:
                kept.append(line)
                continue
        except (ValueError, KeyError, TypeError):
            pass
        dropped += 1
    if dropped:
        tmp = path.parent / (path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)


def _loop(trainer, dataset, checkpointer, state, metrics_path, log, stop_requested, sinks=None,
          profiler=None, goodput=None, watch=None, requests=None) -> TrainResult:
    """The steps from `state`'s to `train.steps`. `goodput` (`parallax.goodput`) is told where the time goes,
    `watch` (`parallax.hang`) when a step runs and when anything finishes, `requests` (`_RewindRequests`)
    whether an operator asked for a rewind."""
    t = trainer.plan.train
    requests = requests or _RewindRequests(None, False, log)
    goodput = goodput or Goodput()
    watch = watch or HangWatch(None)
    speed = throughput(trainer.plan, trainer.mesh)
    history, eval_loss, preempted, signalled = [], None, False, 0
    step = first_step = int(state["step"])
    rows = trainer.host_rows()
    run_start = time.perf_counter()
    batch = trainer.device_batch(dataset.batch(step, rows=rows)) if step < t.steps else None
    last = time.perf_counter()
    goodput.add("data", last - run_start)
    evaluated = False  # the eval program has run (its first run compiles: not watched for hangs)
    streak = 0  # spikes in a row (train.spike_policy)
    while step < t.steps:
        if profiler is not None:
            profiler.before(step + 1)
        compiles = not trainer.compiled_for(step)  # this kind of step's first: its time includes the compile
        # A step that compiles is not watched for hangs: neither the compile nor the wait for other hosts
        # still compiling theirs
        with watch.paused() if compiles else contextlib.nullcontext():
            state, metrics = trainer.train_step_at(step)(state, batch)  # dispatched asynchronously
            step += 1
            watch.running(step, timed=not compiles)
            began = time.perf_counter()
            batch = trainer.device_batch(dataset.batch(step, rows=rows)) if step < t.steps else None
            built = time.perf_counter()
            metrics = trainer.path.fetch_metrics(metrics)  # the next batch was built while the device ran it
            watch.finished()
        if profiler is not None:
            profiler.after(step)
        now = time.perf_counter()
        dt, last = now - last, now
        # The device waited for the batch only if the step was over when the batch was ready (the fetch
        # returned at once): then count the batch's time as data (an upper bound), else it was hidden.
        data_wait = built - began if batch is not None and now - built < 1e-3 else 0.0
        goodput.add("data", data_wait)
        goodput.step(step, dt - data_wait, compiled=compiles or step == first_step + 1)
        rewound = None
        if t.spikes:  # non-finite steps are spikes too
            streak = streak + 1 if metrics["spike"] else 0
            if metrics["spike"]:
                log(_spike_line(step, metrics, streak))
            if streak and streak == t.spike_rewind_after:
                began = time.perf_counter()
                with watch.paused():  # a restore is progress, however long it takes
                    state, rewound = _rewind(trainer, checkpointer, state, step, step - streak + 1, log)
                goodput.add("checkpoint", time.perf_counter() - began)
                if rewound is not None:
                    goodput.rewound(rewound, step)
                    streak = 0
        else:
            _check_finite(step, metrics, t.nan_policy, log)
        record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(metrics["lr"]), **speed.metrics(dt), "step_time_s": dt,
                  "epoch": round(dataset.epoch(step), 6)}
        if not metrics["completed"]:  # no batch completed (a pipeline without flush, at its first step):
            # no loss to log (NaN is not JSON)
            del record["loss"], record["grad_norm"]
        elif not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):  # a skipped step's
            del record["loss"], record["grad_norm"]  # (nan_policy or spike_policy): strict JSON has no NaN
            record["non_finite"] = 1
        record.update({k: float(v) for k, v in metrics.get("model", {}).items()})  # e.g. MoE router statistics
        # a step path's own (e.g. DiLoCo's outer step), on the steps that have them (NaN on the others)
        record.update({k: float(v) for k, v in metrics.get("path", {}).items() if math.isfinite(float(v))})
        if t.spikes and metrics["spike"]:
            record["spike_skipped"] = 1
            if rewound is not None:
                record["rewound_to"] = rewound  # batches rewound + 1 .. step are skipped: the step count goes on
        if step == first_step + 1 or compiles:
            record["includes_compile"] = True
        if t.eval_every > 0 and (step % t.eval_every == 0 or step == t.steps):
            began = time.perf_counter()
            with contextlib.nullcontext() if evaluated else watch.paused():
                eval_loss = record["eval_loss"] = evaluate(trainer, state["params"], dataset, t.eval_batches)
                for source in dataset.mixture_sources:  # a mixture: each source's own eval split too
                    record[f"eval_loss/{source}"] = evaluate(trainer, state["params"], dataset, t.eval_batches,
                                                             source)
            evaluated = True
            watch.progress()
            last = time.perf_counter()  # eval time is not step time
            goodput.add("eval", last - began)
        if step % t.log_every == 0 or step == t.steps or "eval_loss" in record or "spike_skipped" in record:
            record.update(goodput.metrics())
            history.append(record)
            if metrics_path is not None:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            if sinks is not None:  # TensorBoard, W&B
                sinks.write(record)
            eta = (time.perf_counter() - run_start) / (step - first_step) * (t.steps - step)
            log(_progress_line(record, t.steps, eta))
        signalled, request = _stop_signal(stop_requested(), requests.poll())
        if request:  # every host read it: back to a checkpoint (parallax/train.py `_RewindRequests`)
            began = time.perf_counter()
            with watch.paused():
                target = step if request == 1 else request - 2
                state, rewound = _rewind(trainer, checkpointer, state, step, target + 1, log,
                                         f"a rewind requested in {requests.path}")
            goodput.add("checkpoint", time.perf_counter() - began)
            if rewound is not None:
                goodput.rewound(rewound, step)
            requests.done()
        preempted = bool(signalled) or checkpointer.reached_preemption(step)  # Orbax's policy saves this step
        began = time.perf_counter()
        if checkpointer.maybe_save(step, state, force=step == t.steps or preempted):
            goodput.saving(step)
        last = time.perf_counter()  # save time is not step time either
        goodput.add("checkpoint", last - began)
        watch.progress()
        goodput.persist()
        if preempted:  # train_and_evaluate says so, once the last save is done
            break
    return TrainResult(history=history, eval_loss=eval_loss, state=state, trainer=trainer, preempted=preempted,
                       stop_signal=signalled)


def _spike_line(step, metrics, streak) -> str:
    what = (f"loss {float(metrics['loss']):.4g}, grad_norm {float(metrics['grad_norm']):.4g}"
            if metrics["finite"] else "a non-finite loss or gradient")
    return f"step {step}: spike ({what}); update skipped (train.spike_policy=skip), {streak} in a row"


def _rewind(trainer, checkpointer, state, step, first_spike, log, why=None):
    """The state of the last checkpoint saved before step `first_spike` (or the oldest kept), with the step
    count of `step`: the parameters and optimizer state go back, the batches after the checkpoint up to
    `step` are skipped (the data position is the step). Returns (state, the checkpoint's step), or (state,
    None) when no checkpoint is saved yet. `why`: what asked (default: the spike policy)."""
    why = why or f"{trainer.plan.train.spike_rewind_after} spikes in a row"
    saved = checkpointer.complete_steps()
    if not saved:
        log(f"step {step}: {why}, but no checkpoint to rewind to yet; going on")
        return state, None
    before = [s for s in saved if s < first_spike]
    target = max(before) if before else min(saved)
    restored = checkpointer.restore(trainer.abstract_state(), target)
    restored["step"] = state["step"]
    log(f"step {step}: {why}: rewound the parameters and "
        f"optimizer state to the checkpoint of step {target}{'' if before else ' (the oldest kept)'}; the batches "
        f"of steps {target + 1}-{step} are skipped")
    return restored, target


def _check_finite(step, metrics, nan_policy, log):
    if metrics["finite"]:
        return
    if nan_policy == "stop":
        raise TrainingError(
            f"step {step}: non-finite loss or gradient (loss {float(metrics['loss'])}, grad_norm "
            f"{float(metrics['grad_norm'])}); stopped without saving this step. Lower optim.lr, "
            f"check the data, or set train.nan_policy=skip")
    log(f"step {step}: non-finite loss, update skipped (train.nan_policy=skip)")


# Model metrics (`Model.aux_metrics`) short enough for the progress line; metrics.jsonl has them all.
_PROGRESS_MODEL_METRICS = ("aux_loss", "load_cv", "dropped")


def _progress_line(record, steps, eta) -> str:
    step, width = record["step"], 20
    done = int(width * step / max(steps, 1))
    bar = "[" + "#" * done + "-" * (width - done) + f"] {100 * step / max(steps, 1):3.0f}%"
    losses = (f"loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f}" if "loss" in record else
              "loss non-finite" if record.get("non_finite") else "(no batch completed yet)")
    line = (f"{bar} step {step}/{steps} {losses} lr {record['lr']:.2e} {record['tokens_per_sec']:,.0f} tok/s "
            f"{record['step_time_s']:.3f} s/step eta {eta:.0f}s")
    if "mfu" in record:
        line += f" mfu {100 * record['mfu']:.1f}%"
    if "eval_loss" in record:
        line += f" eval_loss {record['eval_loss']:.4f}"
    for key in _PROGRESS_MODEL_METRICS:
        if key in record:
            line += f" {key} {record[key]:.3g}"
    if record.get("includes_compile"):
        line += " (first step: includes compilation)"
    return line
