"""A headless Chromium driven through the DevTools protocol over a pipe (no driver package, no socket).

`--remote-debugging-pipe` makes Chromium read protocol commands from its fd 3 and write replies
and events to its fd 4, each message JSON ended by a NUL byte. Used by the demo's browser test
and to take the README's screenshot:

    with Chromium() as browser:
        browser.open("http://127.0.0.1:7860")
        browser.evaluate("document.title")
        browser.screenshot("page.png")
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

# Debian's chromium; the flags keep a headless browser off the network but for the page it is sent to
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--metrics-recording-only",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    def __init__(self, executable: str | None = None, width: int = 1400, height: int = 1000, timeout: float = 60):
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise FileNotFoundError("no chromium on PATH")
        self.width, self.height, self.timeout = width, height, timeout
        self.next_id, self.session = 0, None

    def __enter__(self) -> Chromium:
        self.profile = tempfile.mkdtemp(prefix="visar-chromium-")
        to_browser, self.commands = os.pipe()  # we write commands, Chromium reads them on its fd 3
        self.replies, from_browser = os.pipe()  # Chromium writes on its fd 4, we read

        def plumb():  # in the child, before exec: the pipe ends at fds 3 and 4
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.process = subprocess.Popen(
            [
                self.executable,
                *FLAGS,
                f"--user-data-dir={self.profile}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=plumb,
        )
        os.close(to_browser)
        os.close(from_browser)
        self.buffer = b""
        pages = [t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        target = pages[0]["targetId"] if pages else self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return self

    def __exit__(self, *exc):
        try:
            self.send("Browser.close", session=False)
        except Exception:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self.commands)
        os.close(self.replies)
        shutil.rmtree(self.profile, ignore_errors=True)

    # -- the protocol ------------------------------------------------------------------------------
    def send(self, method: str, session: bool = True, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = self.read_message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise TimeoutError(f"no reply to {method} in {self.timeout} s")

    def read_message(self) -> dict:
        while b"\0" not in self.buffer:
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                raise ConnectionError("chromium closed its DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    # -- what a test does --------------------------------------------------------------------------
    def open(self, url: str):
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", what=f"{url} to load")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str = "", timeout: float = 60, every: float = 0.1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(every)
        raise TimeoutError(f"waited {timeout} s for {what or expression}")

    def screenshot(self, path: str | os.PathLike, full_page: bool = True) -> Path:
        params = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.send("Page.captureScreenshot", **params)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path
