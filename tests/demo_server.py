"""What the tests of `visar demo` share (tests/apps/test_demo.py, tests/apps/test_commands.py): the demo extra,
a free port, and a demo server started, awaited and stopped."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch


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


def start_demo(model: str, method: str, port: int) -> subprocess.Popen:
    # the server decodes at this process's torch thread count (one under xdist, conftest.py): a test that
    # compares its AR image with one decoded here, byte for byte, then sees the same rounding
    threads = str(torch.get_num_threads())
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads}
    command = [sys.executable, "-m", "visar", "demo", "--model", model, "--method", method, "--port", str(port)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(process: subprocess.Popen, url: str, seconds: float = 180):
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            pytest.fail(f"visar demo exited with {process.returncode}: {process.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"visar demo did not answer within {seconds:.0f} s")
        time.sleep(0.5)


def stop(process: subprocess.Popen):
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
