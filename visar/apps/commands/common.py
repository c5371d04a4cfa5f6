"""What several commands share: the model and sampling flags, loading the model, reading --opt."""

from __future__ import annotations

import argparse
import json

from ...errors import VisarError


def parse_option(text: str, flag: str = "--opt") -> tuple[str, object]:
    """`key=value` -> (key, value) with value read as JSON when it parses (numbers, true, null)."""
    if "=" not in text:
        raise VisarError(f"{flag} takes key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.replace("-", "_"), value


def add_model_args(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default="default",
        help="registered name (see `visar models`; an official preset fetches its released files from the "
        "Hugging Face Hub), a Hub repository (e.g. deepseek-community/Janus-Pro-1B, amused/amused-256: through "
        "huggingface_hub's cache, HF_HOME and HF_HUB_OFFLINE) or a model folder; default: the embedded default model",
    )
    group.add_argument("--revision", help="with a Hub repository or preset: the branch, tag or commit to fetch")
    group.add_argument(
        "--text-encoder",
        help="text-to-image LlamaGen: the T5 encoder for --prompt, a folder or Hub name (t2i presets: "
        "google/flan-t5-xl, fetched on first use)",
    )
    group.add_argument("--checkpoint", help="official checkpoint file, for official presets (e.g. c2i_B_256.pt)")
    group.add_argument("--vq-checkpoint", help="official VQ checkpoint file (e.g. vq_ds16_c2i.pt)")
    group.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a load option, repeatable (values read as JSON when they parse): for an Emu3 folder image_area, "
        "ratio, negative_prompt, negative_prompt_format (text or generation), max_prompt_tokens; for a Janus "
        "folder max_prompt_tokens; for a Lumina-mGPT folder width, height, max_prompt_tokens, text_tokenizer, vq, "
        "version; for an aMUSEd folder negative_prompt, aesthetic_score, crop_coord; with "
        "--checkpoint and `llamagen`, the model's constructor arguments",
    )
    group.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)")
    group.add_argument("--dtype", default="fp32", help="generator dtype: fp32, bf16 or fp16 (default fp32)")
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile the generator (each new input shape compiles on first use; on CPU this needs a C++ "
        "compiler; where compiling fails, a warning says why and the run continues eagerly); default --no-compile",
    )
    group.add_argument(
        "--compile-mode",
        help="torch.compile mode with --compile (e.g. reduce-overhead: CUDA graphs on a GPU; max-autotune); "
        "default: torch's",
    )


def load_pipeline(args):
    """The model of --model/--checkpoint/--vq-checkpoint on --device in --dtype, compiled with --compile."""
    from ...loading import load

    model_args = dict(parse_option(text, "--model-arg") for text in args.model_arg) or None
    pipe = load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        checkpoint=args.checkpoint,
        vq_checkpoint=args.vq_checkpoint,
        model_args=model_args,
        revision=args.revision,
        text_encoder=args.text_encoder,
    )
    if hasattr(args, "method"):  # the sampling flags' --method: unset or "auto" resolved as generate does
        args.method = pipe.resolve_method(args.method)
        check_method(pipe, args.method, dict(parse_option(o) for o in args.opt))
    return pipe.compile(**compile_kwargs(args)) if args.compile else pipe


def check_method(pipe, method: str, options: dict):
    """The method, its option names and the model's kind checked before a command writes anything, as generate
    would check them; an unknown method is said with the methods that decode this model (not every kind's).
    Option values are the method's own to check, at its first call."""
    from ...accel import METHODS, methods_for
    from ...models.base import model_kind

    if method not in METHODS:
        kind = model_kind(pipe.model)
        raise VisarError(
            f"unknown method {method!r}; the methods that decode {pipe.name} (a {kind} model): "
            f"{', '.join(methods_for(pipe.model))} (`visar methods` lists every kind's)"
        )
    METHODS[method].check_options(options)  # in generate's order (visar.pipeline.runs.checked_method)
    METHODS[method].check_model(pipe.model, pipe.name)


def compile_kwargs(args) -> dict:
    return {"mode": args.compile_mode} if args.compile_mode else {}


def add_sampling_args(parser: argparse.ArgumentParser, default_method: str | None = None):
    """The sampling flags; --method defaults to `default_method`, or (None) the model kind's reference."""
    group = parser.add_argument_group("sampling (unset values take the model's defaults, see `visar models -v`)")
    if default_method == "auto":
        method_help = (
            "decoding method (see `visar methods`); default auto: the fastest lossless method for this model, "
            "device, batch size and sampling (raster models: ar, mc-sjd at 8 / 16 / 32 slots or tree-mc-sjd, "
            "timed on the first images of the first runs and kept in the cache folder; other kinds: their "
            "reference, e.g. maskgit for masked models)"
        )
    else:
        method_help = (
            "decoding method (see `visar methods`); default the model kind's reference: ar for raster models, "
            "maskgit for masked ones"
        )
    group.add_argument("--method", default=default_method, help=method_help)
    group.add_argument("--seed", type=int, default=0, help="image i uses seed + i (default 0)")
    group.add_argument(
        "--guidance-scale", "--cfg", type=float, help="classifier-free guidance scale, 0 to 1e4 (1 = off)"
    )
    group.add_argument("--temperature", type=float, help="softmax temperature, 1e-4 to 1e4")
    group.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    group.add_argument(
        "--entropy-temperature",
        type=float,
        metavar="T0",
        help="raster, masked and next-scale models: each position's temperature T0 (2.5 exp(-H/3) + 0.6), H the "
        "entropy (nats) of its guided, top-k / top-p filtered distribution, applied after the filters (Ma et al. "
        "2025; 1.4 and 1.0 in its scripts), 1e-4 to 1e4; in place of --temperature (default: off)",
    )
    group.add_argument(
        "--kv-keep",
        type=float,
        metavar="FRACTION",
        help="raster models, any method: keep this fraction of the KV-cache slots, in (0, 1] (lossy below 1: "
        "the condition and the last two grid rows are kept, older slots evicted by attention; default 1, exact)",
    )
    group.add_argument(
        "--kv-evict",
        metavar="RULE",
        help="with --kv-keep below 1, how the cache chooses what to evict: h2o (the default: on each write that "
        "needs room, the slots with the least attention so far, decayed) or line (LineAR: at each grid-row "
        "boundary, a row's worth of the slots the last row's queries attended least)",
    )
    group.add_argument(
        "--deterministic",
        action="store_true",
        help="decode each image alone (on CUDA under torch's deterministic algorithms): its tokens are then "
        "bit-identical at any --batch-size, on resume and under torchrun (same device and thread count); "
        "without it they are the same law, and the same bits only on a CPU at one torch thread. Costs "
        "the batching's throughput",
    )
    group.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method option, repeatable (e.g. --opt window=16); see `visar methods`",
    )


def add_negative_prompt_arg(parser: argparse.ArgumentParser):
    parser.add_argument(
        "--negative-prompt",
        metavar="TEXT",
        help="text-conditional models: the unconditional branch of guidance for every prompt, in place of the "
        "model's own (LlamaGen t2i: its null caption; Emu3 and aMUSEd: their load-time negative prompt; Janus: "
        "the padded prompt); used under guidance (a guidance scale other than 1: the model's default or --cfg)",
    )


def check_negative_prompt(pipe, args):
    """--negative-prompt refused (class-conditional model, an empty one the encoder cannot encode, too long)
    before a run writes anything, with the sentence generate would raise (in the CLI's words)."""
    from ..batch import check_negatives

    if getattr(args, "negative_prompt", None) is not None:
        check_negatives(pipe, [args.negative_prompt], "leave out --negative-prompt")


def run_settings(pipe, args) -> dict:
    """What of the command line decides a run's pixels besides model, method and seed (recorded for resuming):
    checkpoint files, method options and the resolved sampling settings (unset: the model's defaults)."""
    params = pipe.sampling_params(
        args.guidance_scale, args.temperature, args.top_k, args.top_p, args.entropy_temperature
    )
    if getattr(args, "kv_keep", None) is not None:  # refused before a folder is made or a bar drawn
        pipe.check_kv_keep(args.kv_keep)
    if getattr(args, "kv_evict", None) is not None:
        from ...models.base import check_kv_evict

        check_kv_evict(args.kv_evict)
    return {
        "checkpoint": args.checkpoint,
        "vq_checkpoint": args.vq_checkpoint,
        "options": dict(parse_option(o) for o in args.opt),
        "sampling": {
            **{k: getattr(params, k) for k in ("guidance_scale", "temperature", "top_k", "top_p")},
            **entropy_kwargs(params.entropy_temperature),  # only when on: runs without it keep their settings
        },
        **negative_prompt_kwargs(args),  # only when given: runs without one keep their settings
        **kv_keep_kwargs(args),  # likewise
        **deterministic_kwargs(args),  # likewise: a resume repeats it, so its files are the bits of one run
    }


def entropy_kwargs(entropy_temperature) -> dict:
    return {} if entropy_temperature is None else {"entropy_temperature": entropy_temperature}


def negative_prompt_kwargs(args) -> dict:
    negative = getattr(args, "negative_prompt", None)
    return {} if negative is None else {"negative_prompt": negative}


def kv_keep_kwargs(args) -> dict:
    """--kv-keep and --kv-evict, where given."""
    return {name: getattr(args, name) for name in ("kv_keep", "kv_evict") if getattr(args, name, None) is not None}


def deterministic_kwargs(args) -> dict:
    return {"deterministic": True} if getattr(args, "deterministic", False) else {}


def generate_kwargs(args) -> dict:
    return dict(
        guidance_scale=args.guidance_scale,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        entropy_temperature=args.entropy_temperature,
        **negative_prompt_kwargs(args),
        **kv_keep_kwargs(args),
        **deterministic_kwargs(args),
        **dict(parse_option(o) for o in args.opt),
    )
