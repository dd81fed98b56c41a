"""One root for every error ksow reports to a user: the CLI maps any KsowError to a one-line message
and exit status 1; anything else is a bug and keeps its traceback."""


class KsowError(Exception):
    """Root of ksow's errors; its message is written for the user."""


class InputError(KsowError, ValueError):
    """An input that cannot be applied; its message is the `sow-error` reason on `<topic>.errors`."""


class ConfigError(KsowError, ValueError):
    """A configuration (topology, client settings, command options) that cannot be used."""


class UnsupportedByEngine(ConfigError):
    """A topology needs a capability the chosen engine does not have."""


class BatchAborted(Exception):
    """A runner gave up the batch in flight (its transaction could not commit) while the engine was
    applying an input: the engine lets it through instead of blaming the input."""
