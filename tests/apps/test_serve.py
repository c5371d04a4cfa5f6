"""`visar serve` (visar/apps/serve): one server on a free 127.0.0.1 port for the module, stopped at its end.

Concurrent requests share the running batch and each image's tokens are `visar generate`'s with its
seed, bit for bit (the server decodes at one torch thread, as the images it is compared with); bad input gets one
sentence and 400 / 422 and the server keeps serving; past the queue 429 with Retry-After; past a
deadline 504, and a caller that disconnects, each with its images out of their slots; SIGTERM answers
what is in flight and exits 0; /metrics speaks Prometheus.
"""

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from demo_server import free_port

MODEL, METHOD, SLOTS, MAX_QUEUE = "visar-tiny-c2i", "mc-sjd", 4, 8


def start_server(port: int, *flags: str) -> subprocess.Popen:
    for module in ("litserve", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            if os.environ.get("CI"):
                pytest.fail(f"{module} missing in CI: .ci/run installs the serve extra (pip install -e '.[serve]')")
            pytest.skip(f"{module} is not installed: pip install -e '.[serve]'")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the server makes its own
    command = [sys.executable, "-m", "visar", "serve", "--model", MODEL, "--port", str(port), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            pytest.fail(f"visar serve exited with {process.returncode}: {process.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.read() == b"ok":
                    return process
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("visar serve did not answer /health within 120 s")
        time.sleep(0.3)


def stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail("visar serve did not stop within 60 s of SIGTERM")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    flags = ("--method", METHOD, "--slots", str(SLOTS), "--max-queue", str(MAX_QUEUE), "--max-n", "4")
    process = start_server(port, *flags)
    yield f"http://127.0.0.1:{port}"
    assert stop(process) == 0


def post(url: str, body, timeout: float = 120) -> tuple[int, object, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}/v1/images/generations", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " ") or line.startswith(name + "{"))


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


@pytest.fixture(scope="module")
def pipe():
    import visar

    return visar.load(MODEL, device="cpu")


@pytest.mark.one_thread  # the images it compares were decoded at one thread by the server too
def test_concurrent_requests_each_get_generates_images_with_their_seed_and_settings(server, pipe):
    """Eight requests at once (one of three images), three of them with a method, guidance scale or entropy
    temperature of their own, which wait for a batch of their settings: every image's tokens are
    `generate`'s for its class, seed, method and sampling settings, bit for bit, and it says its method
    and passes."""
    bodies = [dict(class_label=c, seed=s, n=n) for c, s, n in ((3, 0, 1), (7, 5, 3), (3, 1, 1), (12, 9, 1), (0, 2, 2))]
    bodies[2:2] = [dict(class_label=4, seed=6, n=2, method="sjd"), dict(class_label=5, seed=8, guidance_scale=1.5)]
    bodies.append(dict(class_label=6, seed=4, entropy_temperature=1.4))
    answers = [None] * len(bodies)
    threads = [
        threading.Thread(target=lambda k=k, body=body: answers.__setitem__(k, post(server, body)))
        for k, body in enumerate(bodies)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    for body, (status, _, answer) in zip(bodies, answers, strict=True):
        assert status == 200, answer
        assert len(answer["data"]) == body.get("n", 1)
        method = body.get("method", METHOD)
        alone = pipe.generate(
            class_labels=[body["class_label"]], num_images_per_prompt=body.get("n", 1), seed=body["seed"],
            method=method, guidance_scale=body.get("guidance_scale"), output_type="tokens",
            entropy_temperature=body.get("entropy_temperature"),
        )  # fmt: skip
        for image, tokens in zip(answer["data"], alone.tokens, strict=True):
            # the server decodes each image's pixels alone (a VQ decoder's batch of 2 rounds otherwise)
            expected = pipe.to_output(pipe.decode(tokens[None]), "pil")[0]
            assert np.array_equal(pixels(image["b64_json"]), np.asarray(expected)), body
            assert image["visar"]["method"] == method and image["visar"]["forward_passes"] > 0
    assert metric(server, "visar_images_total") >= 12 and metric(server, "visar_passes_total") > 0


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b'{"class_label": 3,', 422, "not valid JSON"),
        ({"class_label": 3, "quality": "hd"}, 422, "unknown field 'quality'"),
        ({"class_label": 3, "seed": -1}, 422, "seed"),
        ({"class_label": 3, "n": 5}, 400, "at most 4"),
        ({"prompt": "a red circle"}, 400, "give class_label"),
        ({"class_label": 3, "method": "gsd"}, 400, "method must be one of"),
        ({"class_label": 3, "size": "1024x1024"}, 400, "size must be 64x64"),
        ({"class_label": 3, "model": "dall-e-3"}, 400, "serves visar-tiny-c2i"),
        ({"class_label": 3, "entropy_temperature": 0}, 422, "entropy_temperature"),
        ({"class_label": 3, "entropy_temperature": 1e9}, 400, "entropy_temperature must be"),
    ],
)
def test_bad_input_gets_one_sentence_and_the_server_keeps_serving(server, body, status, words):
    got, _, answer = post(server, body)
    assert got == status and words in answer["error"]["message"], answer
    assert "\n" not in answer["error"]["message"]
    assert post(server, {"class_label": 1, "seed": 4})[0] == 200


def test_past_the_queue_requests_get_429_with_retry_after_and_nothing_else_fails(server):
    """Twice the queue's requests at once: each is answered once, 200 or 429 (Retry-After), some of each."""
    answers = []
    threads = [
        threading.Thread(target=lambda k=k: answers.append(post(server, {"class_label": k % 40, "n": 2, "seed": k})))
        for k in range(2 * MAX_QUEUE)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    statuses = sorted(status for status, _, _ in answers)
    assert len(answers) == 2 * MAX_QUEUE and set(statuses) == {200, 429}, statuses
    assert all(headers.get("Retry-After") == "1" for status, headers, _ in answers if status == 429)


def slots_empty(url: str, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while metric(url, "visar_slots_in_use") > 0 or metric(url, "visar_requests_in_flight") > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_request_past_its_deadline_gets_504_and_frees_its_slots(server):
    status, _, answer = post(server, {"class_label": 5, "n": 4, "timeout": 0.05})
    assert status == 504 and "deadline" in answer["error"]["message"]
    assert slots_empty(server)
    assert post(server, {"class_label": 5, "seed": 1})[0] == 200


@pytest.mark.one_thread  # its last image against one decoded here
def test_callers_that_disconnect_leave_their_slots_and_disturb_no_one(server, pipe):
    """Two callers of four images each leave 0.1 s after asking: their images leave the slots unfinished
    (fewer than their 8 images are ever made), counted as 499, and the next request is as alone."""
    left, made = (metric(server, name) for name in ('visar_requests_total{status="499"}', "visar_images_total"))
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"class_label": 9, "n": 4, "seed": 3}).encode()
    for _ in range(2):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.1)  # its images take slots, then the caller leaves
    assert slots_empty(server)
    assert metric(server, 'visar_requests_total{status="499"}') == left + 2
    assert metric(server, "visar_images_total") < made + 8
    status, _, answer = post(server, {"class_label": 9, "seed": 3})
    alone = pipe.generate(class_labels=[9], seed=3, method=METHOD, output_type="tokens").tokens
    assert status == 200
    expected = pipe.to_output(pipe.decode(alone), "pil")[0]
    assert np.array_equal(pixels(answer["data"][0]["b64_json"]), np.asarray(expected))


def test_a_streamed_request_gets_each_image_as_an_event_then_done(server):
    request = urllib.request.Request(
        f"{server}/v1/images/generations",
        data=json.dumps({"class_label": 2, "n": 2, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    images = [json.loads(event) for event in events[:-1]]
    assert sorted(image["index"] for image in images) == [0, 1]
    assert all(image["type"] == "image_generation.completed" and image["b64_json"] for image in images)


def test_metrics_are_prometheus_text(server):
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as response:
        text = response.read().decode()
        assert response.headers["Content-Type"].startswith("text/plain")
    for name in ("visar_requests_in_flight", "visar_slots_in_use", "visar_images_total", "visar_passes_total"):
        assert f"# TYPE {name}" in text
    assert "visar_request_seconds_bucket" in text and "visar_tokens_per_pass_bucket" in text


@pytest.mark.slow  # a server of its own
def test_sigterm_answers_the_requests_in_flight_then_exits_0():
    port = free_port()
    process = start_server(port, "--method", METHOD, "--slots", "2")
    url = f"http://127.0.0.1:{port}"
    answers = []
    threads = [
        threading.Thread(target=lambda k=k: answers.append(post(url, {"class_label": k, "n": 3, "seed": k})))
        for k in range(3)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # in flight
    process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    try:  # a new request is refused while the server drains (or, once it has stopped, cannot connect)
        refused = post(url, {"class_label": 1}, timeout=10)[0] == 503
    except OSError:
        refused = True
    for thread in threads:
        thread.join(120)
    assert process.wait(timeout=60) == 0
    assert refused and sorted(status for status, _, _ in answers) == [200, 200, 200]
    assert all(len(answer["data"]) == 3 for _, _, answer in answers)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--method", "ar"], "--method must be auto or a method that refills"),
        (["--slots", "0"], "--slots must be >= 1"),
        (["--port", "80"], "--port must be in 1024..65535"),
        (["--host", "localhost"], "--host must be"),
    ],
)
def test_bad_flags_are_one_line_before_anything_starts(flags, words, capsys):
    from visar.apps.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
