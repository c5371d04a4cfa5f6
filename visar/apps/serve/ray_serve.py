"""visar's running batch as a Ray Serve deployment, for a cluster: each replica loads the model in its device
thread (`pipeline.SharedDevice`) and serves `POST /v1/images/generations` (the fields and answers of
`visar serve`, docs/SERVING.md) and `GET /health` from one running batch of `slots` that its requests'
images join between passes; Ray Serve routes the requests among the replicas (one a GPU with
`num_gpus: 1`), scales them and restarts a failed one.

    pip install -e ".[serve,ray]"
    serve run visar.apps.serve.ray_serve:build model=visar-tiny-c2i method=mc-sjd slots=8   # this machine
    serve deploy ray-serve.yaml                                                            # a cluster

Ray Serve answers each request whole (no `stream`). Its own limits bound a replica: past
`max_ongoing_requests` a request queues at Ray's proxy, past `max_queued_requests` it gets 503. A
request past its deadline (`timeout`, at most the deployment's) gets 504 and its images leave their
slots; a caller that disconnects has them cancelled too (Ray Serve cancels the handler).
"""

import asyncio
import time

from fastapi import FastAPI  # no `from __future__ import annotations`: Ray Serve reads the handlers' types as objects
from fastapi.exceptions import RequestValidationError
from ray import serve

from ...errors import VisarError
from ...pipeline.shared_device import SharedDevice
from .api import PATH, ImagesRequest, ServedModel, error, validation_message

app = FastAPI(title="visar")


@app.exception_handler(RequestValidationError)
async def one_sentence(request, exc: RequestValidationError):
    return error(422, validation_message(exc))


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(app)
class VisarImages:
    """One replica: a model, its running batch of `slots`, at most `max_n` images a request and `timeout`
    seconds (docs/SERVING.md: `visar serve`'s flags of the same names)."""

    def __init__(
        self, model="default", method="auto", slots=8, max_n=8, timeout=300.0, options=None, device=None, dtype=None
    ):
        import visar

        self.shared, self.timeout = SharedDevice(int(slots)), float(timeout)

        def load() -> ServedModel:  # in the device thread, which runs every batch
            pipe = visar.load(model, device=device, dtype=dtype)
            return ServedModel(pipe, model, method, dict(options or {}), int(slots), int(max_n))

        self.model = self.shared.call(load).result()

    @app.get("/health")
    def health(self) -> dict:
        return {"status": "ok", "model": self.model.pipe.name}

    @app.post(PATH)
    async def generations(self, body: ImagesRequest):
        if body.stream:
            return error(400, "this deployment answers whole requests: leave stream out")
        try:
            label, job = self.model.job(body.model_dump())
        except VisarError as err:
            return error(400, str(err))
        loop, started, images = asyncio.get_running_loop(), time.monotonic(), []
        ended = loop.create_future()  # None, or the error the images ended with

        def end(outcome):
            loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(outcome))

        job.on_image = lambda position, image, info: images.append(
            self.model.image(label, position, image, info, started)
        )  # in the device thread, as each image is done
        job.on_done, job.on_error = lambda: end(None), end
        self.shared.submit(job)
        try:
            failure = await asyncio.wait_for(asyncio.shield(ended), min(body.timeout or self.timeout, self.timeout))
        except asyncio.TimeoutError:
            self.shared.cancel(job)
            return error(504, "the request ran past its deadline (the deployment's timeout, or its own timeout)")
        except asyncio.CancelledError:  # the caller left
            self.shared.cancel(job)
            raise
        if failure is not None:
            status = 400 if isinstance(failure, VisarError) else 500
            return error(status, str(failure) if status == 400 else f"the decode failed: {failure}")
        images.sort(key=lambda image: image.pop("index"))
        return {"created": int(time.time()), "data": images}


def build(args: dict) -> serve.Application:
    """Ray Serve's application builder (`serve run visar.apps.serve.ray_serve:build key=value ...`, or a
    config file's `args`): model, method, slots, max_n, timeout, device, dtype, and options as `opt.K=V`."""
    known = {"model", "method", "slots", "max_n", "timeout", "device", "dtype"}
    options = {key[4:]: value for key, value in args.items() if key.startswith("opt.")}
    unknown = set(args) - known - {f"opt.{key}" for key in options}
    if unknown:
        raise VisarError(f"unknown arguments {sorted(unknown)}: give {', '.join(sorted(known))} or opt.KEY=VALUE")
    return VisarImages.bind(**{key: args[key] for key in known & set(args)}, options=parse_values(options))


def parse_values(options: dict) -> dict:
    """`opt.window=8` arrives as the string "8": each option's value as `visar serve --opt` reads it."""
    from ..commands.common import parse_option

    return dict(parse_option(f"{key}={value}") for key, value in options.items())
