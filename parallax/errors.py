"""The errors parallax raises for a user to fix. A leaf: it imports nothing of parallax, so every layer may
raise them (docs/design.md, "Layers and file map")."""


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming key, value and the fix."""


# Exit statuses of the launchers (docs/checkpoints.md, "Exit statuses"): what a scheduler can act on.
EXIT_ERROR = 1  # an unexpected error (a traceback): a bug or the environment; look before rerunning
EXIT_BAD_INPUT = 2  # a config, data or workdir error (one line naming it): fix it; a rerun fails the same way
EXIT_PEER_LOST = 3  # another process of the run stopped: rerun every process (replace the lost host)
EXIT_HANG = 4  # no progress (train.hang_timeout_s / hang_factor): stacks in WORKDIR/hang/; rerun resumes
EXIT_NON_FINITE = 5  # a non-finite loss or gradient with train.nan_policy=stop: change the run, then rerun
# 128 + the signal: saved and stopped on SIGTERM or a preemption notice (143) or Ctrl-C (130); rerun resumes
