"""The HTTP side of `visar serve`: a LitServe spec (`LitSpec`, as LitServe's OpenAISpec is) that serves
`POST /v1/images/generations` with OpenAI's Images fields and visar's, and `GET /metrics`.

FastAPI checks the body against `ImagesRequest` (422, one sentence: `validation_error`); what needs the
model (a prompt to a class model, the size, the method) the worker checks (400). Past `max_queue`
requests in flight a request gets 429 with Retry-After; past its deadline 504, and its images leave
their slots (a cancel through LitServe's request queue); a caller that disconnects has its images
cancelled the same way. While the server drains (SIGTERM) new requests get 503.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import time
import uuid
from collections import deque

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem

from . import metrics
from .api import PATH, ImagesRequest, error, validation_message


class Disconnected(Exception):
    pass


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's list of errors -> 422 with the first as one sentence."""
    metrics.REQUESTS.labels("422").inc()
    return error(422, validation_message(exc))


class ImagesSpec(LitSpec):
    """POST /v1/images/generations and GET /metrics over the worker's continuous batching."""

    def __init__(self, max_queue: int, timeout: float):
        super().__init__()
        self.api_path = PATH
        self.max_queue, self.timeout = max_queue, timeout
        self.in_flight, self.draining = 0, False
        self.add_endpoint(PATH, self.generations, ["POST"])
        self.add_endpoint("/metrics", self.metrics, ["GET"])

    @property
    def stream(self):
        return True  # LitServe's continuous batching streams each request's messages to this side

    def decode_request(self, request, context_kwargs=None):
        return request

    def encode_response(self, output, context_kwargs=None):
        return output

    async def metrics(self) -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    async def generations(self, body: ImagesRequest, request: Request):
        if self.draining:
            return self.answer(error(503, "the server is shutting down and takes no new requests"))
        if self.in_flight >= self.max_queue:
            message = f"{self.in_flight} requests are in flight, this server's limit: retry after a second"
            return self.answer(error(429, message, {"Retry-After": "1"}))
        self.in_flight += 1
        metrics.IN_FLIGHT.inc()
        uid, started = str(uuid.uuid4()), time.monotonic()
        deadline = started + min(body.timeout or self.timeout, self.timeout)
        messages, event = deque(), asyncio.Event()
        self.response_buffer[uid] = ResponseBufferItem(event=event, response_queue=messages)
        self.request_queue.put((self.response_queue_id, uid, time.monotonic(), body.model_dump()))
        finished = False
        try:
            first = await self.receive(uid, messages, event, request, deadline)
            if isinstance(first, Response):
                return self.answer(first)
            if body.stream:
                finished = True  # the stream's own end does the bookkeeping
                return StreamingResponse(
                    self.events(uid, messages, event, request, started, deadline), media_type="text/event-stream"
                )
            images = []
            while (message := await self.receive(uid, messages, event, request, deadline)) is not None:
                if isinstance(message, Response):
                    return self.answer(message)
                images.append(message)
            images.sort(key=lambda image: image.pop("index"))
            metrics.LATENCY.observe(time.monotonic() - started)
            return self.answer(JSONResponse({"created": int(time.time()), "data": images}))
        except Disconnected:
            self.cancel(uid)
            return self.answer(Response(status_code=499))  # nobody reads it; counted as nginx counts it
        finally:
            if not finished:
                self.done(uid)

    async def events(self, uid, messages, event, request, started, deadline):
        """Server-sent events: each image as it is done (OpenAI's image_generation.completed), then [DONE]."""
        try:
            while (message := await self.receive(uid, messages, event, request, deadline)) is not None:
                if isinstance(message, Response):
                    yield f"data: {json.dumps({'type': 'error', **json.loads(message.body)})}\n\n"
                    metrics.REQUESTS.labels(str(message.status_code)).inc()
                    return
                yield f"data: {json.dumps({'type': 'image_generation.completed', **message})}\n\n"
            metrics.LATENCY.observe(time.monotonic() - started)
            metrics.REQUESTS.labels("200").inc()
            yield "data: [DONE]\n\n"
        except (Disconnected, asyncio.CancelledError):
            self.cancel(uid)
            metrics.REQUESTS.labels("499").inc()
            raise
        finally:
            self.done(uid)

    async def receive(self, uid, messages: deque, event: asyncio.Event, request: Request, deadline: float):
        """The worker's next message for `uid`: a dict (accepted, or an image), None at its end, or an error
        Response (the worker's 400 / 500, or 504 past the deadline, its images then cancelled); raises
        Disconnected when the caller has gone."""
        while not messages:
            left = deadline - time.monotonic()
            if left <= 0:
                self.cancel(uid)
                return error(504, "the request ran past its deadline (the server's --timeout, or its own timeout)")
            try:
                await asyncio.wait_for(event.wait(), min(left, 0.25))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise Disconnected from None
            event.clear()
        data, status = messages.popleft()
        if status == LitAPIStatus.FINISH_STREAMING:
            return None
        if status == LitAPIStatus.ERROR:
            failure = pickle.loads(data) if isinstance(data, bytes) else data
            if isinstance(failure, HTTPException):
                return error(failure.status_code, str(failure.detail))
            return error(500, f"the worker failed: {failure}")
        return json.loads(data)  # {"accepted": n}, or an image

    def answer(self, response: Response) -> Response:
        metrics.REQUESTS.labels(str(response.status_code)).inc()
        return response

    def cancel(self, uid: str):
        self.request_queue.put((self.response_queue_id, str(uuid.uuid4()), time.monotonic(), {"cancel": uid}))

    def done(self, uid: str):
        self.response_buffer.pop(uid, None)
        self.in_flight -= 1
        metrics.IN_FLIGHT.dec()
