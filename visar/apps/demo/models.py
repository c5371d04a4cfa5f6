"""The demo's models: pipelines loaded once per (name, device) and shared by every session, and what
the page says about a model (its classes, an example prompt, one line on it)."""

from __future__ import annotations

import threading

from ...errors import VisarError
from ...models.base import model_kind
from ...pipeline.shared_device import SharedDevice
from ...registry import DEFAULT_MODEL, embedded_models, proxy_models, resolve_name

# A text model opens with the first of these its prompt encoder reads word for word (the shapes
# world's caption encoder knows 30 words; a T5 or a Hugging Face tokenizer reads any).
EXAMPLE_PROMPTS = ("a red fox in the snow", "a photo of a red circle above a blue square")


class ModelCache:
    """Pipelines loaded once per (name, device), shared read-only by every session, and the one thread
    that runs everything on the device (`shared`: a model, and a draft model shared by names, keeps its
    KV cache in itself during a decode): loads and reference runs one at a time, and the method sides of
    sessions that click together with the same settings in one running batch of `slots`."""

    def __init__(self, device=None, dtype=None, allow_folders: bool = True, slots: int = 4):
        self.device, self.dtype, self.allow_folders = device, dtype, allow_folders
        self.pipes: dict[tuple[str, str], object] = {}
        self.loading = threading.Lock()
        self.shared = SharedDevice(slots, fit=True, name="visar-demo-device")

    def get(self, name: str):
        from ...loading import load

        name = resolve_name((name or "").strip() or DEFAULT_MODEL)
        if name not in embedded_models() and not self.allow_folders:
            raise VisarError(
                f"unknown model {name!r}: this server serves only its embedded models "
                f"({', '.join(embedded_models())}); start it with --allow-folders to load model folders"
            )
        key = (name, str(self.device))
        with self.loading:
            if key not in self.pipes:
                # in the device thread, which runs every decode (torch is slower on a CPU in another)
                self.pipes[key] = self.shared.call(load, name, device=self.device, dtype=self.dtype).result()
            return self.pipes[key]


def model_choices() -> list[str]:
    proxies = proxy_models()
    return [name for name in embedded_models() if name not in proxies]


def class_choices(pipe) -> list[str]:
    if not pipe.is_class_conditional:
        return []
    names = pipe.class_names or []
    return [names[i] if i < len(names) else str(i) for i in range(pipe.num_classes)]


def example_prompt(pipe) -> str:
    """A prompt to open a text model's page with."""
    known = getattr(pipe.text_encoder, "word_index", None)
    for prompt in EXAMPLE_PROMPTS:
        if known is None or all(word in known for word in prompt.split()):
            return prompt
    return EXAMPLE_PROMPTS[0]


def model_info(pipe) -> str:
    """One line on the model: its conditions, its tokens (a next-scale model: its scales) and its device."""
    kind = f"{pipe.num_classes} classes" if pipe.is_class_conditional else "text prompts"
    sizes = getattr(pipe.model, "scale_sizes", None)
    if sizes:  # a next-scale model has no single grid: scale maps 1x1 .. pn x pn
        tokens = f"{len(sizes)} scales up to {sizes[-1]}x{sizes[-1]} ({pipe.model.num_image_tokens} tokens)"
    else:
        height, width = pipe.model.grid_size
        tokens = f"{height}x{width} tokens"
    return f"`{pipe.name}`: {model_kind(pipe.model)} model, {kind}, {tokens}, on {pipe.device}"
