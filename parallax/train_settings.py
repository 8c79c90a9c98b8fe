"""The training loop's settings (`config.train`), checked and typed once: `resolve(section) -> TrainSettings`.

The loop (`parallax/train.py`), the trainer and the step paths read `TrainSettings`, never the section;
every `config.train.*` error is raised here (one line: key, value, fix). The batch's divisibility by the
data-parallel size is `check_batch`, called by the plan once the mesh is known.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from parallax.errors import ConfigError

# The section `config.train`.
KEYS = dict(
    steps=100,  # optimizer steps of the run
    global_batch_size=8,  # sequences per step, over all devices
    seq_len=64,  # tokens per sequence
    seed=0,  # parameters and data order (a batch is a function of seed, step and row)
    microbatches=1,  # gradient accumulation: the batch in this many pieces, one at a time
    log_every=10,  # steps between progress lines and metrics.jsonl rows
    eval_every=50,  # steps between evals (0: none); also after the last step
    eval_batches=2,  # batches per eval
    checkpoint_every=50,  # steps between checkpoints (0: only the last step and on a stop signal)
    keep_checkpoints=2,  # checkpoints kept (the oldest are deleted)
    async_checkpoint=True,  # save in the background while training goes on
    local_checkpoint_every=0,  # the fast tier: each process's own shards to local disk every N steps (0: off)
    local_checkpoint_keep=2,  # fast-tier steps kept per process (>= 2, so the processes always share one)
    local_checkpoint_dir="",  # the fast tier's directory ('': WORKDIR/local); each process writes process_<i>/
    nan_policy="stop",  # stop | skip: on a non-finite loss or gradient, stop without saving, or skip the step
    spike_policy="off",  # off | skip: skip the update of a step whose loss or gradient norm is a spike
    spike_zscore=6.0,  # a spike: loss or grad_norm above its running mean by this many running std deviations
    spike_window=100,  # the running statistics' horizon (an EMA, in steps); no spikes before this many updates
    spike_rewind_after=3,  # this many spikes in a row: back to the last checkpoint before them (0: never)
    hang_timeout_s=0.0,  # no step, eval or save done for this long (compiles aside): dump stacks, exit 4 (0: off)
    hang_factor=0.0,  # also when a step runs over this multiple of the recent median and over 5 s (0: off)
    sample_tokens=200,  # tokens launch/sample.py generates by default
    profile_steps=(),  # (first, last): jax.profiler trace of those steps into WORKDIR/profile; (): none
    wandb_project="",  # Weights & Biases project to log the metrics to ('': off); needs `pip install wandb`
    wandb_entity="",  # its entity (team or user; '': your default)
    wandb_mode="online",  # online | offline (written under WORKDIR/wandb; `wandb sync` uploads it later)
)
WANDB_MODES = ("online", "offline")
NAN_POLICIES = ("stop", "skip")
SPIKE_POLICIES = ("off", "skip")
# The arrays of a batch, each [rows, seq_len]: tokens in, tokens out, document ids, positions, loss weights.
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """`config.train`, typed (`resolve`)."""
    steps: int
    global_batch_size: int
    seq_len: int
    seed: int
    microbatches: int  # gradient accumulation (without a pipeline)
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int
    async_checkpoint: bool
    nan_policy: str  # stop | skip
    sample_tokens: int
    profile_steps: tuple  # () or (first, last)
    spike_policy: str = "off"  # off | skip (`parallax.trainer.Trainer.update`, the loop's rewind)
    spike_zscore: float = 6.0
    spike_window: int = 100
    spike_rewind_after: int = 3
    hang_timeout_s: float = 0.0  # parallax.hang: 0 = off
    hang_factor: float = 0.0
    wandb_project: str = ""  # '' : no Weights & Biases
    wandb_entity: str = ""
    wandb_mode: str = "online"
    local_checkpoint_every: int = 0  # parallax.checkpoint.LocalTier: 0 = off
    local_checkpoint_keep: int = 2
    local_checkpoint_dir: str = ""  # '': WORKDIR/local

    @property
    def spikes(self) -> bool:
        """`spike_policy=skip`: the state carries running loss / grad-norm statistics (`state['spike']`)."""
        return self.spike_policy != "off"

    @property
    def skip_nonfinite(self) -> bool:
        """`nan_policy=skip`: a step with a non-finite loss or gradient applies nothing."""
        return self.nan_policy == "skip"

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs of one global batch."""
        return batch_shapes(self.global_batch_size, self.seq_len)


def batch_shapes(rows: int, seq_len: int) -> dict:
    """ShapeDtypeStructs of a batch of `rows` rows of `seq_len` tokens (`BATCH_KEYS`)."""
    return {k: jax.ShapeDtypeStruct((rows, seq_len), jnp.float32 if k == "weights" else jnp.int32)
            for k in BATCH_KEYS}


def resolve(section) -> TrainSettings:
    """`config.train` as `TrainSettings`; raises ConfigError naming the key, the value and the fix."""
    t = section
    for key in ("steps", "global_batch_size", "seq_len", "log_every", "keep_checkpoints", "microbatches"):
        if int(t[key]) <= 0:
            raise ConfigError(f"config.train.{key}={t[key]}: must be >= 1")
    for key in ("eval_every", "checkpoint_every", "local_checkpoint_every"):
        if int(t[key]) < 0:
            raise ConfigError(f"config.train.{key}={t[key]}: must be >= 0 (0 turns it off)")
    if int(t.local_checkpoint_keep) < 2:
        raise ConfigError(f"config.train.local_checkpoint_keep={t.local_checkpoint_keep}: must be >= 2 (a process "
                          "killed mid-save holds one step fewer than the others; two kept leave one they share)")
    if t.eval_every and t.eval_batches <= 0:
        raise ConfigError(f"config.train.eval_batches={t.eval_batches}: must be >= 1 when eval_every > 0")
    profile = tuple(t.profile_steps)
    if profile and (len(profile) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in profile)
                    or not 1 <= profile[0] <= profile[1] <= t.steps):
        raise ConfigError(f"config.train.profile_steps={profile}: expected two steps FIRST,LAST with 1 <= FIRST <= "
                          f"LAST <= train.steps={t.steps}, e.g. --config.train.profile_steps=3,5 (step 1 includes "
                          f"compilation), or () for no profile")
    if t.nan_policy not in NAN_POLICIES:
        raise ConfigError(f"config.train.nan_policy={t.nan_policy!r}: expected stop or skip")
    if t.spike_policy not in SPIKE_POLICIES:
        raise ConfigError(f"config.train.spike_policy={t.spike_policy!r}: expected off or skip")
    if not float(t.spike_zscore) > 0:
        raise ConfigError(f"config.train.spike_zscore={t.spike_zscore}: must be > 0 (e.g. 6: six running "
                          "standard deviations above the running mean)")
    if int(t.spike_window) < 2:
        raise ConfigError(f"config.train.spike_window={t.spike_window}: must be >= 2 (steps in the running "
                          "statistics, e.g. 100)")
    if int(t.spike_rewind_after) < 0:
        raise ConfigError(f"config.train.spike_rewind_after={t.spike_rewind_after}: must be >= 0 (0: never rewind)")
    for key in ("hang_timeout_s", "hang_factor"):
        if not float(t[key]) >= 0:
            raise ConfigError(f"config.train.{key}={t[key]}: must be >= 0 (0 turns it off)")
    if 0 < float(t.hang_factor) <= 1:
        raise ConfigError(f"config.train.hang_factor={t.hang_factor}: a multiple of the median step, so over 1 "
                          "(e.g. 10), or 0 for off")
    if t.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"config.train.wandb_mode={t.wandb_mode!r}: expected online or offline")
    if t.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"config.train.wandb_project={t.wandb_project!r}: needs the wandb package; "
                              "pip install wandb, or leave wandb_project empty")
    return TrainSettings(
        steps=int(t.steps), global_batch_size=int(t.global_batch_size), seq_len=int(t.seq_len), seed=int(t.seed),
        microbatches=int(t.microbatches), log_every=int(t.log_every), eval_every=int(t.eval_every),
        eval_batches=int(t.eval_batches), checkpoint_every=int(t.checkpoint_every),
        keep_checkpoints=int(t.keep_checkpoints), async_checkpoint=bool(t.async_checkpoint),
        nan_policy=str(t.nan_policy), spike_policy=str(t.spike_policy), spike_zscore=float(t.spike_zscore),
        spike_window=int(t.spike_window), spike_rewind_after=int(t.spike_rewind_after),
        hang_timeout_s=float(t.hang_timeout_s), hang_factor=float(t.hang_factor),
        sample_tokens=int(t.sample_tokens), profile_steps=profile,
        wandb_project=str(t.wandb_project), wandb_entity=str(t.wandb_entity), wandb_mode=str(t.wandb_mode),
        local_checkpoint_every=int(t.local_checkpoint_every), local_checkpoint_keep=int(t.local_checkpoint_keep),
        local_checkpoint_dir=str(t.local_checkpoint_dir))


def check_batch(train: TrainSettings, data_parallel: int) -> None:
    """The global batch splits over `data_parallel` ways (DiLoCo's replicas included) x `microbatches`."""
    if train.global_batch_size % (data_parallel * train.microbatches):
        raise ConfigError(
            f"config.train.global_batch_size={train.global_batch_size}: must be divisible by data-parallel size "
            f"{data_parallel} (mesh.replica included) x microbatches {train.microbatches} = "
            f"{data_parallel * train.microbatches}")
