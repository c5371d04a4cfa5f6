"""`visar demo`: a model's reference decoding and an accelerated method side by side, on one seed.

One click samples the chosen class or prompt (with its negative prompt, if one is given) twice,
with the reference of the model's kind (`ar` for raster models) and with the chosen method, each
image from one `torch.Generator` seeded with the seed, and shows both images, their forward passes,
step compression (image tokens / forward passes), sampling time, the measured speed-up (sampling
time against sampling time, bold only where the method was faster; none for the reference against
itself), the one-time set-up apart (auto's AR-step probe on a model's first call), what auto did
(on its default candidates its first 12 to 20 clicks on a model time them, one image a click:
"image N of M", M the fewest to the most images its walk can still take; the click where it ends
says what that click ran and, apart, the winner, which later clicks run; the candidates it never
timed, and why), the class or prompt and negative prompt used, and whether the method is lossless
at these options; a status line with the table's sampling times and speed-up; then how the method
decoded: a heatmap over the token grid of the forward pass that committed each token
(`stats["commit_pass"]`; for a next-scale model every scale's map, in lines) and the tokens
committed per pass (an axis from 0). The note under the images says what the chosen
method guarantees (lossless, or lossy and what it trades). A click checks the inputs first (a bad
one is one message, nothing cleared), then clears the previous result and generates; choosing a
model clears the last model's result, and a text model opens with an example prompt.

Sessions share the loaded models (one per name and device, never changed after loading) and one
device thread (`pipeline.SharedDevice`), since a model keeps its KV cache between the forward passes
of one decode: a click's method side joins the running batch of the clicks in flight with its
settings where the method refills its slots (sjd, mc-sjd, the trees, the zipar fronts: each image
still its decode alone; its sampling time then runs from joining to done, with the passes it shared),
and the reference, auto and the methods that do not refill run between batches, one at a time.
--concurrency clicks are served at once (the batch's slots); Gradio's queue bounds those waiting.
User errors (`VisarError`: unknown class, empty prompt, an option out of range, a folder that is
not a model, a method that does not decode the model) come back as a message in the page; the
server goes on serving. The API (gradio_client) has three endpoints, /select_model, /select_method
and /generate, each parameter and output named; /select_model takes any method and shows the
model's default where it does not fit.
"""

from .auto_account import auto_note
from .comparison import (
    DISPLAY_PX,
    commit_heatmap,
    compare,
    condition_text,
    map_lines,
    reference_label,
    run_side,
    seconds_text,
    speedup_text,
    status_line,
    summary_markdown,
    tokens_per_pass,
    upscale,
)
from .models import EXAMPLE_PROMPTS, ModelCache, class_choices, example_prompt, model_choices, model_info
from .options import (
    MAX_OPTION_TEXT,
    MAX_OPTIONS,
    MAX_SEED,
    PageInputs,
    check_field,
    check_sizes,
    condition_of,
    default_options,
    negative_of,
    parse_options,
    prepared,
)
from .page import (
    DEFAULT_METHOD,
    EMPTY_VIEWS,
    FIRST_METHODS,
    build_demo,
    guarantee_note,
    is_loopback,
    launch,
    method_info,
    page_handlers,
    preselected_method,
)

__all__ = [
    "auto_note",
    "build_demo",
    "check_field",
    "check_sizes",
    "class_choices",
    "commit_heatmap",
    "compare",
    "condition_of",
    "condition_text",
    "DEFAULT_METHOD",
    "default_options",
    "DISPLAY_PX",
    "EMPTY_VIEWS",
    "example_prompt",
    "EXAMPLE_PROMPTS",
    "FIRST_METHODS",
    "guarantee_note",
    "is_loopback",
    "launch",
    "map_lines",
    "MAX_OPTION_TEXT",
    "MAX_OPTIONS",
    "MAX_SEED",
    "method_info",
    "model_choices",
    "model_info",
    "ModelCache",
    "negative_of",
    "page_handlers",
    "PageInputs",
    "parse_options",
    "prepared",
    "preselected_method",
    "reference_label",
    "run_side",
    "seconds_text",
    "speedup_text",
    "status_line",
    "summary_markdown",
    "tokens_per_pass",
    "upscale",
]
