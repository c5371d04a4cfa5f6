"""Errors that mean "the user asked for something wrong", as opposed to bugs.

The CLI turns these into one line on stderr and exit code 2, with no traceback.
"""


class VisarError(ValueError):
    """Bad input from the user: unknown name, bad option, wrong checkpoint, missing file."""


class CheckpointMismatchError(VisarError):
    """A checkpoint whose keys or shapes do not fit the model it is loaded into."""


class MissingDependencyError(VisarError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str):
    """Import an optional dependency or fail with one sentence naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"'{module}' is not installed: install it with `pip install 'visar-ar[{extra}]'`"
        ) from err
