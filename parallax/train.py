"""The training loop: data, eval, logging, metrics, checkpoints and preemption around the jitted steps.

`train_and_evaluate(config, workdir)` is the library entry point (the launcher calls it): it makes the
plan and the `Trainer` (`parallax.trainer`), resumes from the workdir's latest checkpoint, trains with a
progress line and `metrics.jsonl`, evaluates every `train.eval_every` steps by the training loss path,
saves every `train.checkpoint_every` steps, and on SIGTERM saves and returns.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time

import jax
import numpy as np
from etils import epath

from parallax import checkpoint as ckpt_lib
from parallax import data as data_lib
from parallax import mesh as mesh_lib
from parallax.config import ConfigError, config_from_json
from parallax.defaults import with_defaults
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


def make_dataset(config) -> data_lib.Dataset:
    d, t = config.data, config.train
    try:
        dataset = data_lib.make_dataset(
            d.source, d.path, seq_len=t.seq_len, global_batch_size=t.global_batch_size, seed=t.seed,
            vocab_size=config.model.vocab_size, eval_fraction=d.eval_fraction,
            eos_id=None if d.eos_id < 0 else d.eos_id)
    except data_lib.DataError as e:
        raise ConfigError(f"config.data: {e}") from None
    if t.eval_every and dataset.streams["eval"] is None:
        raise ConfigError(f"config.data.eval_fraction={d.eval_fraction}: the corpus at {d.path or 'the default'} "
                          f"has no eval documents; raise eval_fraction or set train.eval_every=0")
    return dataset


def evaluate(trainer: Trainer, params, dataset, num_batches: int) -> float:
    """Mean token loss over the first `num_batches` batches of the eval split."""
    total = np.zeros(2)
    for i in range(num_batches):
        batch = trainer.device_batch(dataset.batch(i, "eval", rows=trainer.host_rows()))
        total += np.asarray(trainer.eval_step(params, batch))
    return float(total[0] / max(total[1], 1.0))


_MUST_MATCH_ON_RESUME = ("model", "data", "optim", "train.seed", "train.global_batch_size", "train.seq_len")
# Memory knobs that do not change the math (blockwise attention and the chunked loss are exact).
_MAY_CHANGE_ON_RESUME = ("model.attention_block", "model.loss_chunk")


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
    may change; the rest of the model, data, optimizer, seed, batch and sequence length may not. `train.steps` may grow only when `optim.decay_steps` fixes the LR schedule.
    """
    saved = _flatten(json.loads(saved_json))
    if "model.name" in saved:  # keys added since the checkpoint was written compare as their defaults
        saved = _flatten(json.loads(with_defaults(config_from_json(saved_json)).to_json_best_effort()))
    now = _flatten(json.loads(config.to_json_best_effort()))
    keys = [k for k in now if (k.startswith(tuple(p + "." for p in ("model", "data", "optim")))
                               or k in _MUST_MATCH_ON_RESUME) and k not in _MAY_CHANGE_ON_RESUME]
    if "model.name" not in saved:
        raise ConfigError("config.model.name: the checkpoint in this workdir was written before models were named "
                          "in the config (and with other parameter names); use a new --workdir")
    if not config.optim.decay_steps:
        keys.append("train.steps")
    for key in keys:
        if key in saved and saved[key] != now[key]:
            hint = (f"; set optim.decay_steps={saved[key]} to extend the run with the same LR schedule"
                    if key == "train.steps" else "; use a new --workdir to start a different run")
            raise ConfigError(f"config.{key}={now[key]!r}: the checkpoint in this workdir was trained with "
                              f"{saved[key]!r}, so resuming would not continue the same run{hint}")


def _stop_requested(flag: bool) -> bool:
    """True on every host if any host received SIGTERM (hosts must stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(multihost_utils.process_allgather(np.int32(flag)).max())




def train_and_evaluate(config, workdir: str, devices=None, log=print) -> TrainResult:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; the library entry point.

    Only process 0 writes `config.json` / `metrics.jsonl` and logs. On SIGTERM every host saves the same
    step and returns with `preempted=True`; rerunning the same command continues exactly.
    """
    trainer = Trainer(config, devices)
    dataset = make_dataset(config)
    t = config.train
    lead = jax.process_index() == 0
    log = log if lead else (lambda *_: None)
    workdir = epath.Path(workdir)
    checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", t.checkpoint_every, t.keep_checkpoints,
                                         async_save=t.async_checkpoint)
    stop = {"signal": None}
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))
    try:
        state = _start(trainer, dataset, checkpointer, workdir, lead, log)
        return _loop(trainer, dataset, checkpointer, state, workdir / "metrics.jsonl" if lead else None, log,
                     lambda: stop["signal"] is not None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        checkpointer.close()


def _start(trainer, dataset, checkpointer, workdir, lead, log):
    """The state to train from: restored from the latest checkpoint (after checking that the config
    continues the same run), or freshly initialised (writing `config.json`)."""
    config = trainer.config
    start = checkpointer.latest_step()
    config_path = workdir / "config.json"
    if start is not None and config_path.exists():
        check_resume(config, config_path.read_text())
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        if start is None:
            config_path.write_text(config.to_json_best_effort(indent=2))
    log(f"parallax: {mesh_lib.describe(trainer.mesh)}; model {config.model.name} "
        f"{trainer.num_params / 1e6:.2f}M params; {dataset.describe()}")
    if start is None:
        return trainer.init_state()
    state = checkpointer.restore(trainer.abstract_state(), start)  # straight onto the mesh's shardings
    log(f"resumed from {checkpointer.directory} at step {start}")
    return state


def _loop(trainer, dataset, checkpointer, state, metrics_path, log, stop_requested) -> TrainResult:
    t = trainer.config.train
    history, eval_loss, preempted = [], None, False
    step = first_step = int(state["step"])
    rows = trainer.host_rows()
    run_start = last = time.perf_counter()
    batch = trainer.device_batch(dataset.batch(step, rows=rows)) if step < t.steps else None
    while step < t.steps:
        state, metrics = trainer.train_step(state, batch)  # dispatched asynchronously
        step += 1
        batch = trainer.device_batch(dataset.batch(step, rows=rows)) if step < t.steps else None
        metrics = jax.device_get(metrics)  # the next batch was built while the device ran this step
        now = time.perf_counter()
        dt, last = now - last, now
        _check_finite(step, metrics, t.nan_policy, log)
        record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(metrics["lr"]), "tokens_per_sec": t.global_batch_size * t.seq_len / dt,
                  "step_time_s": dt}
        record.update({k: float(v) for k, v in metrics.get("model", {}).items()})  # e.g. MoE router statistics
        if step == first_step + 1:
            record["includes_compile"] = True
        if t.eval_every > 0 and (step % t.eval_every == 0 or step == t.steps):
            eval_loss = record["eval_loss"] = evaluate(trainer, state["params"], dataset, t.eval_batches)
            last = time.perf_counter()  # eval time is not step time
        if step % t.log_every == 0 or step == t.steps or "eval_loss" in record:
            history.append(record)
            if metrics_path is not None:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            eta = (time.perf_counter() - run_start) / (step - first_step) * (t.steps - step)
            log(_progress_line(record, t.steps, eta))
        preempted = _stop_requested(stop_requested())
        checkpointer.maybe_save(step, state, force=step == t.steps or preempted)
        if preempted:
            log(f"received SIGTERM: saved step {step}; rerun the same command to continue")
            break
    return TrainResult(history=history, eval_loss=eval_loss, state=state, trainer=trainer, preempted=preempted)


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
    line = (f"{bar} step {step}/{steps} loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} "
            f"lr {record['lr']:.2e} {record['tokens_per_sec']:,.0f} tok/s {record['step_time_s']:.3f} s/step "
            f"eta {eta:.0f}s")
    if "eval_loss" in record:
        line += f" eval_loss {record['eval_loss']:.4f}"
    for key in _PROGRESS_MODEL_METRICS:
        if key in record:
            line += f" {key} {record[key]:.3g}"
    if record.get("includes_compile"):
        line += " (first step: includes compilation)"
    return line
