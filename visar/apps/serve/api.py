"""What `POST /v1/images/generations` means for a model, whichever engine serves it (LitServe's `visar
serve`, or a Ray Serve deployment, `ray_serve.py`): the request's fields (`ImagesRequest`), the model's
default method and the methods a request may name (`ServedModel`), a request read into a job of the
device's running batch (`ServedModel.job`, a VisarError sentence where the model refuses it: a 400) and
each finished image as the answer carries it (`ServedModel.image`), and an error as OpenAI's body (`error`)."""

from __future__ import annotations

import base64
import io
import time
from typing import Literal

import torch
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ...errors import VisarError
from ...pipeline.shared_device import BatchImages

PATH = "/v1/images/generations"


class ImagesRequest(BaseModel):
    """OpenAI's Images fields that apply, and visar's."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    class_label: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json"] = "b64_json"
    model: str | None = None
    negative_prompt: str | None = None
    guidance_scale: float | None = Field(None, ge=0)
    entropy_temperature: float | None = Field(None, gt=0)  # T0 of each position's own temperature
    seed: int = Field(0, ge=0)
    method: str | None = None
    stream: bool = False
    timeout: float | None = Field(None, gt=0)  # the caller's deadline in seconds, at most the server's


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error body, one sentence."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> str:
    """FastAPI's list of errors in a body (a 422) -> the first, as one sentence."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ())[1:])
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
    if first.get("type") == "extra_forbidden":
        return f"unknown field {where!r}"
    return f"{where}: {first['msg']}" if where else first["msg"]


def served_methods(model) -> list[str]:
    """The methods a request may name: lossless on this model, refilling a running batch, no draft model."""
    from ...accel import METHODS

    return sorted(
        name
        for name, m in METHODS.items()
        if m.refills and m.model_kind == "raster" and name != "auto" and m.is_lossless({}, model) and not m.needs_draft
    )


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class ServedModel:
    """A pipeline as a server serves it: its default method (`method`, or the candidate auto settles on
    for batches of `slots`: AR's law as mc-sjd at one token a pass where it settles on ar, which does
    not refill), the methods a request may name, its image size, and at most `max_images` a request.
    Made in the device's thread (auto times its candidates there)."""

    def __init__(self, pipe, model_arg: str, method: str, options: dict, slots: int, max_images: int):
        from ...accel.policy.auto import parse_candidates

        self.pipe, self.model_arg, self.max_images = pipe, model_arg, max_images
        self.default = (method, dict(options), method)  # (method, options, its name in answers)
        if method == "auto":
            kind = "class_labels" if pipe.is_class_conditional else "prompts"
            first = [0] if kind == "class_labels" else ["a photo"]
            spec, why = pipe.settle_auto(**{kind: first * slots}, batch_size=slots, **options)
            candidate = parse_candidates(spec)[0]
            if candidate.method == "ar":
                candidate = parse_candidates("mc-sjd:1")[0]
            self.default = (candidate.method, dict(candidate.options), candidate.spec)
            print(f"visar serve: auto settled on {spec}, served as {candidate.spec} ({why})", flush=True)
        pipe.open_batch(self.default[0], slots=slots, **self.default[1]).close()  # a bad option: now
        self.served = served_methods(pipe.model)
        # the model's images as OpenAI's `size` writes them (WIDTHxHEIGHT), read off one decoded image
        grid = torch.zeros(1, *pipe.model.grid_size, dtype=torch.long, device=pipe.device)
        height, width = pipe.decode(grid).shape[-2:]
        self.size = f"{width}x{height}"

    def job(self, request: dict) -> tuple[str, BatchImages]:
        """A request (ImagesRequest's fields) -> (the name of its method in answers, its images' job), or
        one VisarError sentence (a 400)."""
        method, label = (request["method"], request["method"]) if request.get("method") else self.default[::2]
        if method not in self.served:
            raise VisarError(
                f"method must be one of {', '.join(self.served)} (lossless methods a running batch "
                f"decodes), or left out for the server's {self.default[2]}; got {method!r}"
            )
        given = {key: request.get(key) for key in ("guidance_scale", "entropy_temperature")}
        sampling = {"guidance_scale": self.pipe.sampling_params(**given).guidance_scale}  # a bad value: a 400
        if given["entropy_temperature"] is not None:  # with temperature 1 (sampling_params)
            sampling["entropy_temperature"] = given["entropy_temperature"]
        options = self.default[1] if label == self.default[2] else {}
        return label, BatchImages(self.pipe, method, {**options, **sampling}, self.add_kwargs(request))

    def add_kwargs(self, request: dict) -> dict:
        pipe, n = self.pipe, request.get("n", 1)
        if request.get("model") not in (None, pipe.name, self.model_arg):
            raise VisarError(f"this server serves {pipe.name}, not {request['model']!r}")
        if n > self.max_images:
            raise VisarError(f"n must be at most {self.max_images} images a request on this server, got {n}")
        prompt, label = request.get("prompt"), request.get("class_label")
        if pipe.is_class_conditional:
            if prompt is not None or label is None:
                raise VisarError(
                    f"{pipe.name} draws a class: give class_label (0..{pipe.num_classes - 1}), not a prompt"
                )
            condition = {"class_labels": [label]}
        else:
            if label is not None or not prompt:
                raise VisarError(f"{pipe.name} draws a text prompt: give prompt, not a class_label")
            condition = {"prompts": [prompt]}
        size = request.get("size")
        if size is not None and size != self.size:
            raise VisarError(f"size must be {self.size} for {pipe.name} (or left out), got {size!r}")
        return dict(
            **condition, negative_prompt=request.get("negative_prompt"), num_images_per_prompt=n, seed=request["seed"]
        )

    def image(self, label: str, position: int, image, info: dict, started: float) -> dict:
        """A finished image as the answer's `data` holds it (PNG, base64), with its method, options, forward
        passes and seconds since its request came (`started`, time.monotonic)."""
        figures = {"method": label, "forward_passes": int(info["forward_passes"])}
        figures["seconds"] = round(time.monotonic() - started, 4)
        if label == self.default[2] and self.default[1]:  # --opt, or auto's size
            figures["options"] = self.default[1]
        return {"index": position, "b64_json": png_base64(image), "visar": figures}
