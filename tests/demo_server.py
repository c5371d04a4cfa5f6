"""What the tests of `visar demo` share (tests/test_demo.py, tests/test_commands.py): a free port, the demo extra."""

import os
import socket

import pytest


def needs(module: str):
    """The demo extra: in CI it must be installed (`.ci/run` installs it), elsewhere its absence skips."""
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{module} missing in CI: .ci/run installs the demo extra (pip install -e '.[demo]')")
        pytest.skip(f"{module} is not installed: pip install -e '.[demo]'")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
