"""visar's running batch as a Ray Serve deployment (`visar/apps/serve/ray_serve.py`), on a local Ray instance
this module starts (2 CPUs, no dashboard, HTTP on a free 127.0.0.1 port) and stops.

Concurrent requests share a replica's running batch and each image is `generate`'s with its seed, bit for
bit at one torch thread; bad input gets one sentence and the replica keeps serving; a request past its
deadline gets 504 and the next one is exact.
"""

import base64
import io
import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from demo_server import free_port

MODEL, METHOD = "visar-tiny-c2i", "mc-sjd"


def needs_ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray[serve] missing in CI: .ci/run installs the ray extra (pip install -e '.[ray]')")
        pytest.skip("ray[serve] is not installed: pip install -e '.[ray]'")


def test_the_builder_reads_ray_serve_s_string_arguments():
    needs_ray()
    from visar.apps.serve.ray_serve import build, parse_values
    from visar.errors import VisarError

    assert parse_values({"window": "8", "coupling": "gumbel", "tail": 2}) == {
        "window": 8,
        "coupling": "gumbel",
        "tail": 2,
    }
    with pytest.raises(VisarError, match=r"unknown arguments \['slot'\]"):
        build({"model": MODEL, "slot": "4"})


@pytest.fixture(scope="module")
def deployment():
    needs_ray()
    import ray
    from ray import serve

    from visar.apps.serve.ray_serve import build

    port = free_port()
    # one torch thread in the replica, as in the test process: the images are compared bit for bit
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"model": MODEL, "method": METHOD, "slots": "4", "max_n": "4"}), blocking=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def post(url: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/v1/images/generations", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


@pytest.fixture(scope="module")
def pipe():
    import visar

    return visar.load(MODEL, device="cpu")


def assert_generates(pipe, body: dict, answer: dict):
    method = body.get("method", METHOD)
    alone = pipe.generate(
        class_labels=[body["class_label"]], num_images_per_prompt=body.get("n", 1), seed=body["seed"], method=method,
        output_type="tokens",
    )  # fmt: skip
    assert len(answer["data"]) == len(alone.tokens)
    for image, tokens in zip(answer["data"], alone.tokens, strict=True):
        expected = pipe.to_output(pipe.decode(tokens[None]), "pil")[0]  # the replica decodes each image alone
        assert np.array_equal(pixels(image["b64_json"]), np.asarray(expected)), body
        assert image["visar"]["method"] == method and image["visar"]["forward_passes"] > 0


@pytest.mark.slow  # Ray's start and stop: about 20 s
@pytest.mark.one_thread  # the images it compares were decoded at one thread by the replica too
def test_a_ray_serve_replica_serves_concurrent_requests_from_its_running_batch(deployment, pipe):
    with urllib.request.urlopen(f"{deployment}/health", timeout=30) as response:
        assert json.loads(response.read()) == {"status": "ok", "model": MODEL}
    bodies = [dict(class_label=3, seed=0), dict(class_label=7, seed=5, n=3), dict(class_label=4, seed=6, method="sjd")]
    bodies.append(dict(class_label=12, seed=9, n=2))
    with ThreadPoolExecutor(len(bodies)) as clients:  # all at once
        answers = list(clients.map(lambda body: post(deployment, body), bodies))
    for body, (status, answer) in zip(bodies, answers, strict=True):
        assert status == 200, answer
        assert_generates(pipe, body, answer)
    # bad input: one sentence each, and the replica keeps serving
    for body, status, words in [
        ({"class_label": 3, "quality": "hd"}, 422, "unknown field 'quality'"),
        ({"class_label": 3, "seed": -1}, 422, "seed"),
        ({"prompt": "a fox"}, 400, "draws a class"),
        ({"class_label": 3, "n": 5}, 400, "at most 4"),
        ({"class_label": 3, "method": "nope"}, 400, "method must be one of"),
        ({"class_label": 3, "stream": True}, 400, "whole requests"),
        ({"class_label": 3, "timeout": 0.001}, 504, "deadline"),
    ]:
        got, answer = post(deployment, body)
        assert got == status and words in answer["error"]["message"], answer
        assert "\n" not in answer["error"]["message"]
    body = dict(class_label=9, seed=3)
    status, answer = post(deployment, body)
    assert status == 200
    assert_generates(pipe, body, answer)
