"""The one exception type for bad user input, and the exit code it ends a command with."""

# Every command (training, the dry run, Hydra's run-folder check) exits with this on a ConfigError.
EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A config value, data folder or launch layout that cannot work.

    The message names the offending key(s) and the numbers involved; the CLI prints it alone
    (no traceback) and exits non-zero on every rank.
    """
