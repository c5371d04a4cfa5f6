"""Errors that mean "the user asked for something wrong", as opposed to bugs.

The CLI turns these into one line on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

import importlib


class VisarError(ValueError):
    """Bad input from the user: unknown name, bad option, wrong checkpoint, missing file.

    cli: the same sentence in the command line's words (its flags, not the Python API's keywords), where the
    two differ; the CLI prints it in place of the message, so neither interface reads the other's words."""

    def __init__(self, message: str = "", *, cli: str | None = None):
        super().__init__(message)
        self.cli = cli


class CheckpointMismatchError(VisarError):
    """A checkpoint whose keys or shapes do not fit the model it is loaded into."""


class MissingDependencyError(VisarError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


# The optional modules visar imports, by the extra of pyproject.toml that installs them: the CLI names the
# extra when one is missing, wherever the import is (`missing_dependency`).
EXTRA_OF_MODULE = {
    "scipy": "eval",
    "torch_fidelity": "eval",
    "skimage": "data",
    "gradio": "demo",
    "gradio_client": "demo",
    "transformers": "hf",
    "tokenizers": "hf",
    "diffusers": "hf",
    "litserve": "serve",
    "prometheus_client": "serve",
}


def install_command(extra: str) -> str:
    """How to install one of visar's extras, from the clone visar is installed from (README.md)."""
    return f'pip install -e ".[{extra}]"'


def not_installed(module: str, extra: str) -> MissingDependencyError:
    top = module.partition(".")[0]
    command = install_command(extra)
    return MissingDependencyError(f"'{top}' is not installed: install the {extra} extra with `{command}`")


def require(module: str, extra: str):
    """Import an optional dependency or fail with one sentence naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise not_installed(module, extra) from err


def missing_dependency(err: BaseException) -> MissingDependencyError | None:
    """The sentence naming the extra for an ImportError that comes (itself, or through its causes) from an
    optional module not installed; None for any other (a bug, a broken install: its traceback stays)."""
    while err is not None:
        if isinstance(err, ModuleNotFoundError) and err.name:
            extra = EXTRA_OF_MODULE.get(err.name.partition(".")[0])
            if extra is not None:
                return not_installed(err.name, extra)
        err = err.__cause__ or err.__context__
    return None
