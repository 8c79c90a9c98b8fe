"""TensorBoard event files beside `metrics.jsonl`: the same scalars, under the same names, at the same steps.

`WandbWriter` sends the same records to Weights & Biases when `config.train.wandb_project` is set.
`TensorBoardWriter(logdir, resume_step)` writes with tensorboardX (no TensorFlow needed); a resumed run
purges the steps after the checkpoint it resumed from, as `metrics.jsonl` drops them, so TensorBoard shows
each step once. `read_scalars(logdir)` reads the event files back without TensorBoard (tests, notebooks).

    tensorboard --logdir WORKDIR/tb
"""

from __future__ import annotations

import os
import struct

# metrics.jsonl keys that are not scalars to plot
_NOT_SCALARS = ("step", "includes_compile")


class TensorBoardWriter:
    """Writes each metrics record's numeric values as scalars `key` at its `step`. `resume_step`: the step
    the run resumed from (0 for a new run); events of later steps from an earlier, killed run are purged."""

    def __init__(self, logdir: str, resume_step: int = 0):
        from tensorboardX import SummaryWriter

        self.logdir = str(logdir)
        self._writer = SummaryWriter(self.logdir, purge_step=resume_step + 1 if resume_step else None,
                                     flush_secs=30, filename_suffix=f".{os.getpid()}.{id(self):x}")

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, float(value), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """The same records to a Weights & Biases run (`config.train.wandb_project`). The run's id is kept in
    `WORKDIR/wandb_run_id`, so a resumed run continues the same W&B run; the config is logged once, when the
    run is created. Steps a killed run logged past its checkpoint stay in W&B, and the rerun's repeats of
    them (the same values: resuming is exact) are dropped by W&B, which keeps a run's steps increasing."""

    ID_FILE = "wandb_run_id"

    def __init__(self, workdir, project: str, entity: str, mode: str, config: dict):
        import uuid

        import wandb

        id_path = os.path.join(str(workdir), self.ID_FILE)
        new = not os.path.exists(id_path)
        if new:
            with open(id_path + ".tmp", "w") as f:
                f.write(uuid.uuid4().hex[:16])
            os.replace(id_path + ".tmp", id_path)
        with open(id_path) as f:
            run_id = f.read().strip()
        self._run = wandb.init(project=project, entity=entity or None, id=run_id, resume="allow", mode=mode,
                               dir=str(workdir), config=config if new else None)

    def write(self, record: dict) -> None:
        self._run.log({k: float(v) for k, v in record.items() if k not in _NOT_SCALARS
                       and isinstance(v, (int, float)) and not isinstance(v, bool)}, step=int(record["step"]))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """Every metrics sink of a run (TensorBoard, W&B) behind one `write` / `close`."""

    def __init__(self, sinks):
        self.sinks = list(sinks)

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _records(path: str):
    """The payloads of a TFRecord file (length, length CRC, data, data CRC; CRCs not checked)."""
    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            if len(data) < length or len(f.read(4)) < 4:
                return  # a torn last record (the writer was killed mid-write)
            yield data


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the event files in `logdir`, oldest file first, honouring purges (a
    resumed run's `SessionLog.START` at step s hides the earlier values of steps >= s), as TensorBoard does."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    files = sorted((f for f in os.listdir(logdir) if f.startswith("events.out.tfevents")),
                   key=lambda f: os.path.getmtime(os.path.join(logdir, f)))
    for name in files:
        for data in _records(os.path.join(logdir, name)):
            event = event_pb2.Event.FromString(data)
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                scalars = {tag: [(s, v) for s, v in values if s < event.step] for tag, values in scalars.items()}
            if event.HasField("summary"):
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        scalars.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return scalars
