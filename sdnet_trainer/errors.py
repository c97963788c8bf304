"""The one exception type for bad user input."""


class ConfigError(ValueError):
    """A config value, data folder or launch layout that cannot work.

    The message names the offending key(s) and the numbers involved; the CLI prints it alone
    (no traceback) and exits non-zero on every rank.
    """
