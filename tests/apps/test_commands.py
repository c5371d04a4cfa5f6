"""Every command a user starts, on every kind of model, with its reference method and an accelerated one.

The kinds: raster class- and text-conditional (`visar-tiny-c2i`, `visar-tiny-t2i`), next-scale
(`visar-tiny-var-c2i`, CoDe with its refiner), masked (`visar-tiny-maskgit-c2i`), continuous
(`visar-tiny-mar-c2i`) and a tiny Hugging Face raster model (a random Janus saved with
save_pretrained) where transformers is installed. The commands: `visar generate` and its resume
after an interruption, `visar bench`, `visar eval shapes`, `visar eval fid` (a shard of a few
images; the whole set and its metrics in the slow tier), `visar eval geneval` (text models) and
`visar demo`, started with the model and method as its first choice and driven once through
gradio_client. Faults: an interrupted run resumes to the files of an uninterrupted one; a full
disk or an unwritable folder is one `visar: error:` line, exit 2, and leaves no partial file.

Cheap settings throughout (one or two images, MAR's loop cut to a few steps); in-process calls of
the CLI's `main` in the quick tier, servers and longer runs in the slow one.
"""

import errno
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import run_output_bytes
from demo_server import free_port, needs, start_demo, stop, wait_for
from laws import random_janus, save_janus_folder
from PIL import Image

import visar.accel
import visar.eval.samples
from visar.accel import methods_for
from visar.apps.cli import main

# (model, reference method, accelerated method, cheap options for both, the accelerated method's own)
KINDS = {
    "raster-c2i": ("visar-tiny-c2i", "ar", "mc-sjd", [], []),
    "raster-t2i": ("visar-tiny-t2i", "ar", "sjd", [], []),
    "next-scale": ("visar-tiny-var-c2i", "var", "code", [], ["refiner=visar-tiny-var-c2i-refiner"]),
    "masked": ("visar-tiny-maskgit-c2i", "maskgit", "halton", ["steps=4"], []),
    "continuous": ("visar-tiny-mar-c2i", "mar", "mar-cache", ["num_iter=4", "num_diffusion_steps=5"], []),
    "hf-raster": ("hf-janus", "ar", "sjd", [], []),
}
PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def janus_folder(tmp_path_factory):
    """A tiny random Janus (transformers), saved with save_pretrained: visar loads the folder offline."""
    pytest.importorskip("transformers")

    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield save_janus_folder(random_janus(grid=4, image_vocab=16, seed=0), tmp_path_factory.mktemp("janus"))
    if old is None:
        del os.environ["HF_HUB_OFFLINE"]
    else:
        os.environ["HF_HUB_OFFLINE"] = old


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    """(kind, model name or folder, reference, accelerated, cheap options, the accelerated method's options)."""
    model, reference, fast, cheap, own = KINDS[request.param]
    if model == "hf-janus":
        model = request.getfixturevalue("janus_folder")
    return request.param, model, reference, fast, cheap, own


def is_text(model: str) -> bool:
    return model == "visar-tiny-t2i" or not model.startswith("visar-")


def items(model: str, n: int = 2) -> list[str]:
    if is_text(model):
        return [arg for prompt in PROMPTS[:n] for arg in ("--prompt", prompt)]
    return ["--class", *[str(c) for c in range(1, n + 1)]]


def opts(*lists) -> list[str]:
    return [arg for options in lists for option in options for arg in ("--opt", option)]


RUN_RECORDS = {"stats.json", "summary.json"}  # this run's counts and timings (generated, reused, seconds)


def assert_same_files(folder: Path, whole: Path, kind_name: str):
    """A resumed run wrote the files of one uninterrupted run. MAR (continuous) samples float diffusion
    chains whose rounding depends on the batch's shape under multi-threaded kernels (docs/MAR.md: its
    batch invariance holds to 5e-5 of the scale), so its PNGs may differ by one level in a few pixels
    between batch sizes (23 of 3 x 64 x 64 x 3 seen on 2 threads): they are compared by pixel there."""
    got, want = run_output_bytes(folder, RUN_RECORDS), run_output_bytes(whole, RUN_RECORDS)
    assert sorted(got) == sorted(want)
    for key, data in want.items():
        if kind_name == "continuous" and key.endswith(".png"):
            a, b = (np.asarray(Image.open(io.BytesIO(d)), dtype=np.int16) for d in (got[key], data))
            assert a.shape == b.shape and int(np.abs(a - b).max()) <= 1, key
        else:
            assert got[key] == data, key


def interrupt_after(monkeypatch, images: int, error: BaseException):
    """Make the (images + 1)-th PNG write fail part-way with `error`: some bytes reach the temporary file,
    then the write raises (a ^C, or a full disk)."""
    calls = []
    real_save = Image.Image.save

    def save(image, fp, *args, **kwargs):
        calls.append(fp)
        if len(calls) > images:
            if hasattr(fp, "write"):
                fp.write(b"\x89PNG\r\n\x1a\n partial")
            raise error
        return real_save(image, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)
    return calls


def no_partial_files(folder: Path):
    """Nothing but whole files: no temporary file left, every PNG complete."""
    leftovers = [p.name for p in folder.rglob(".*.tmp")]
    assert not leftovers, f"temporary files left: {leftovers}"
    for png in folder.rglob("*.png"):
        assert visar.eval.samples.is_complete_png(png), f"{png} is cut short"


# -- generate and its resume ------------------------------------------------------------------------------


def generate(model, method, out, *extra) -> int:
    return main(
        ["generate", "--model", model, "--method", method, "--quiet", "--device", "cpu", "--out", str(out), *extra]
    )


def test_generate_with_reference_and_accelerated_method(kind, tmp_path):
    """Both methods on one image: a PNG of the model's size, its record, stats naming the method."""
    name, model, reference, fast, cheap, own = kind
    for method, options in ((reference, cheap), (fast, cheap + own)):
        out = tmp_path / method
        assert generate(model, method, out, *items(model, 1), *opts(options)) == 0
        assert sorted(p.name for p in out.glob("*.png")) == ["00000.png"]
        stats = json.loads((out / "stats.json").read_text())
        assert stats["method"] == method and stats["n"] == 1 and stats["forward_passes_per_image"] > 0
        with Image.open(out / "00000.png") as image:
            assert image.mode == "RGB" and image.width == image.height >= 8


@pytest.mark.one_thread  # a resumed run's files, byte for byte
@pytest.mark.slow  # four runs per kind
@pytest.mark.parametrize("which", ["reference", "accelerated"])
def test_an_interrupted_generate_resumes_to_the_files_of_one_run(kind, which, tmp_path, monkeypatch, capsys):
    name, model, reference, fast, cheap, own = kind
    method, options = (reference, cheap) if which == "reference" else (fast, cheap + own)
    args = [*items(model), "--n", "3", "--seed", "5", *opts(options)]
    assert generate(model, method, tmp_path / "whole", *args, "--batch-size", "3") == 0
    out = tmp_path / "cut"
    interrupt_after(monkeypatch, 1, KeyboardInterrupt())
    assert generate(model, method, out, *args, "--batch-size", "1") == 130
    assert "visar: interrupted" in capsys.readouterr().err
    no_partial_files(out)
    assert sorted(p.name for p in out.glob("*.png")) == ["00000.png"]
    monkeypatch.undo()
    assert generate(model, method, out, *args, "--batch-size", "2") == 0
    assert json.loads((out / "stats.json").read_text())["reused"] == 1
    assert_same_files(out, tmp_path / "whole", name)


@pytest.mark.slow  # every kind; the quick tier checks one (test_a_full_disk_is_one_line_for_every_command)
def test_a_full_disk_during_generate_is_one_line_and_leaves_no_partial_file(kind, tmp_path, monkeypatch, last_error):
    check_full_disk_generate(kind, tmp_path, monkeypatch, last_error)


def check_full_disk_generate(kind, tmp_path, monkeypatch, last_error):
    name, model, reference, fast, cheap, own = kind
    out = tmp_path / "full"
    interrupt_after(monkeypatch, 1, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert generate(model, reference, out, *items(model), "--batch-size", "2", *opts(cheap)) == 2
    error = last_error()
    assert error.startswith("visar: error: cannot write") and "No space left on device" in error
    no_partial_files(out)
    assert sorted(p.name for p in out.glob("*.png")) == ["00000.png"]


def test_an_unwritable_output_folder_is_one_line(tmp_path, last_error):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for command in (
        ["generate", "--class", "1"],
        ["eval", "fid", "--n", "40", "--shard", "0/20"],
        ["eval", "geneval", "--model", "visar-tiny-t2i", "--n-samples", "1"],
    ):
        model = [] if "--model" in command else ["--model", "visar-tiny-c2i"]
        assert main([*command, *model, "--device", "cpu", "--out", str(blocker / "out")]) == 2
        error = last_error()
        assert error.startswith("visar: error: ") and "a-file" in error, (command, error)
    assert blocker.read_text() == "x"


# -- eval fid, eval geneval: resume and full disk ----------------------------------------------------------


def fid_args(model, method, out, options) -> list[str]:
    """A shard of eval fid: two images of a class model's set of 40 (one per class), the first two of a text one."""
    size = ["--n", "40", "--shard", "0/20"] if not is_text(model) else ["--n", "2"]
    return ["eval", "fid", "--model", model, "--method", method, "--device", "cpu", *size, "--out", str(out)] + opts(
        options
    )


@pytest.mark.one_thread  # a resumed run's files, byte for byte
@pytest.mark.slow  # three runs per kind
def test_an_interrupted_eval_fid_resumes_to_the_files_of_one_run(kind, tmp_path, monkeypatch, capsys):
    name, model, reference, fast, cheap, own = kind
    assert main([*fid_args(model, reference, tmp_path / "whole", cheap), "--batch-size", "2"]) == 0
    out = tmp_path / "cut"
    interrupt_after(monkeypatch, 1, KeyboardInterrupt())
    assert main([*fid_args(model, reference, out, cheap), "--batch-size", "1"]) == 130
    no_partial_files(out)
    monkeypatch.undo()
    assert main([*fid_args(model, reference, out, cheap), "--batch-size", "2"]) == 0
    assert "1 images generated, 1 already there" in capsys.readouterr().out
    assert_same_files(out, tmp_path / "whole", name)


@pytest.mark.slow
def test_a_full_disk_during_eval_fid_is_one_line(kind, tmp_path, monkeypatch, last_error):
    check_full_disk_fid(kind, tmp_path, monkeypatch, last_error)


def check_full_disk_fid(kind, tmp_path, monkeypatch, last_error):
    name, model, reference, fast, cheap, own = kind
    out = tmp_path / "full"
    interrupt_after(monkeypatch, 1, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert main([*fid_args(model, reference, out, cheap), "--batch-size", "2"]) == 2
    error = last_error()
    assert error.startswith("visar: error: cannot write") and "No space left on device" in error
    no_partial_files(out)


def geneval_args(model, method, out, options) -> list[str]:
    score = [] if model.startswith("visar-") else ["--no-score"]
    command = ["eval", "geneval", "--model", model, "--method", method, "--device", "cpu", "--out", str(out)]
    return [*command, "--n-samples", "2", *score, *opts(options)]


@pytest.fixture
def one_prompt(tmp_path) -> list[str]:
    """A GenEval metadata file of one shapes-world prompt."""
    path = tmp_path / "metadata.jsonl"
    entry = {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"}
    path.write_text(json.dumps(entry) + "\n")
    return ["--metadata", str(path)]


@pytest.mark.one_thread  # a resumed run's files, byte for byte
@pytest.mark.slow
@pytest.mark.parametrize("kind_name", [k for k, (model, *_) in sorted(KINDS.items()) if is_text(model)])
def test_an_interrupted_eval_geneval_resumes_to_the_files_of_one_run(
    kind_name, request, tmp_path, monkeypatch, one_prompt
):
    """GenEval takes text-conditional models: the raster t2i and the Hugging Face one."""
    model, reference, fast, cheap, own = KINDS[kind_name]
    if model == "hf-janus":
        model = request.getfixturevalue("janus_folder")
    assert main([*geneval_args(model, reference, tmp_path / "whole", cheap), *one_prompt]) == 0
    out = tmp_path / "cut"
    interrupt_after(monkeypatch, 1, KeyboardInterrupt())
    assert main([*geneval_args(model, reference, out, cheap), *one_prompt, "--batch-size", "1"]) == 130
    no_partial_files(out)
    monkeypatch.undo()
    assert main([*geneval_args(model, reference, out, cheap), *one_prompt]) == 0
    assert_same_files(out, tmp_path / "whole", kind_name)


def test_a_full_disk_is_one_line_for_every_command(tmp_path, monkeypatch, last_error, one_prompt):
    """generate, eval fid and eval geneval on a disk that fills at the second image (the cheap masked model;
    every kind: the slow tests above)."""
    masked = ("masked", *KINDS["masked"])
    check_full_disk_generate(masked, tmp_path / "generate", monkeypatch, last_error)
    monkeypatch.undo()
    check_full_disk_fid(masked, tmp_path / "fid", monkeypatch, last_error)
    monkeypatch.undo()
    out = tmp_path / "geneval"
    interrupt_after(monkeypatch, 1, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert main([*geneval_args("visar-tiny-t2i", "ar", out, []), *one_prompt]) == 2
    error = last_error()
    assert error.startswith("visar: error: cannot write") and "No space left on device" in error
    no_partial_files(out)


# -- bench, eval shapes, the whole eval fid -----------------------------------------------------------------


@pytest.mark.slow
def test_bench_runs_the_reference_and_the_accelerated_method(kind, tmp_path, capsys):
    name, model, reference, fast, cheap, own = kind
    options = [f"{method}.{option}" for method in (reference, fast) for option in cheap] + [f"{fast}.{o}" for o in own]
    js = tmp_path / "bench.json"
    args = ["bench", "--model", model, "--methods", fast, "--n", "1", "--device", "cpu", "--json", str(js)]
    assert main([*args, *[a for o in options for a in ("--opt", o)]]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert [row["method"] for row in rows] == [reference, fast]
    assert all(row["forward_passes"] > 0 and row["images_per_s"] > 0 for row in rows)
    assert f"| {fast} |" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_shapes_scores_both_methods(kind, tmp_path):
    name, model, reference, fast, cheap, own = kind
    for method, options in ((reference, cheap), (fast, cheap + own)):
        path = tmp_path / f"{method}.json"
        args = ["eval", "shapes", "--model", model, "--method", method, "--n", "2", "--batch-size", "2"]
        assert main([*args, "--device", "cpu", "--json", str(path), *opts(options)]) == 0
        record = json.loads(path.read_text())
        assert record["method"] == method and record["n"] == 2
        score = record["accuracy"] if "accuracy" in record else record["overall"]
        assert 0 <= score <= 1


@pytest.mark.slow
def test_eval_fid_packs_and_scores_a_few_images_per_method(kind, tmp_path, capsys):
    pytest.importorskip("torch_fidelity")
    name, model, reference, fast, cheap, own = kind
    n = ["--n", "40"] if not is_text(model) else ["--n", "6"]  # precision/recall need 5 images
    runs = {}
    for method, options in ((reference, cheap), (fast, cheap + own)):
        out = tmp_path / method
        command = ["eval", "fid", "--model", model, "--method", method, "--device", "cpu", *n, "--out", str(out)]
        ref = ["--ref", str(runs[reference] / "samples")] if runs else []
        extractor = ["--feature-extractor", "visar-shapes-vq", "--no-isc", "--batch-size", "40"]
        assert main([*command, *extractor, *ref, *opts(options)]) == 0
        runs[method] = out
        assert (out / "samples.npz").is_file()
    record = json.loads((runs[fast] / "metrics.json").read_text())
    assert record["method"] == fast and record["metrics"]["frechet_distance_visar_shapes_vq"] >= 0


# -- the demo ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # one server per kind (about 10 s each)
def test_demo_starts_with_the_model_and_method_and_generates(kind):
    from visar.apps.demo import MAX_OPTIONS, default_options

    gradio_client = needs("gradio_client")
    name, model, reference, fast, cheap, own = kind
    port = free_port()
    process = start_demo(model, fast, port)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for(process, url)
        client = gradio_client.Client(url, verbose=False)
        texts = default_options(fast, model)
        for option in cheap + own:
            key, value = option.split("=", 1)
            texts[key] = value
        fields = list(texts.values()) + [""] * (MAX_OPTIONS - len(texts))
        condition = ("", PROMPTS[0], "") if is_text(model) else ("1", "", "")  # class, prompt, negative prompt
        pipe = visar.load(model, device="cpu")
        d = pipe.defaults
        sampling = (d["guidance_scale"], d["temperature"], d["top_k"] or 0, d["top_p"])
        args = (model, *condition, fast, 3, *sampling, *fields)
        ar_path, method_path, summary, heatmap, per_pass, stats, status = client.predict(*args, api_name="/generate")
        assert stats["ar"]["method"] == reference and stats["method"]["method"] == fast
        assert status.startswith("done") and Image.open(method_path).width >= 256
    finally:
        stop(process)


def test_the_demo_page_describes_every_embedded_model():
    """What `visar demo --model M` reads of its first model before the page is up, for every embedded
    model: the model line, the methods that decode it, each method's option fields."""
    from visar.apps.demo import ModelCache, default_options, model_choices, model_info

    cache = ModelCache(device="cpu")
    for name in model_choices():
        pipe = cache.get(name)
        assert f"`{name}`" in model_info(pipe)
        methods = methods_for(pipe.model)
        assert methods, name
        for method in methods:
            assert list(default_options(method, name)) == visar.accel.METHODS[method].options


@pytest.mark.slow  # gradio's Blocks for every embedded model and each of its methods
def test_the_demo_page_builds_for_every_embedded_model_and_method():
    pytest.importorskip("gradio")
    from visar.apps.demo import build_demo, model_choices

    for name in model_choices():
        for method in methods_for(visar.load(name, device="cpu").model):
            build_demo(model=name, method=method, device="cpu")


@pytest.mark.parametrize(
    "kind_name",
    # raster models in the quick tier: tests/apps/test_demo.py; here the other kinds quick, all of them slow
    [pytest.param(k, marks=pytest.mark.slow) if k.startswith(("raster", "hf")) else k for k in sorted(KINDS)],
)
def test_the_demo_compares_on_every_kind(kind_name, request):
    """The demo's comparison (what its Generate button runs) on every kind, with the model's defaults:
    the kind's reference against the accelerated method, one image each (in-process, no server)."""
    from visar.apps.demo import MAX_OPTIONS, ModelCache, compare, default_options

    model, reference, fast, cheap, own = KINDS[kind_name]
    if model == "hf-janus":
        model = request.getfixturevalue("janus_folder")
    cache = ModelCache(device="cpu")
    pipe = cache.get(model)
    texts = default_options(fast, model)
    texts.update(dict(option.split("=", 1) for option in cheap + own))
    fields = list(texts.values()) + [""] * (MAX_OPTIONS - len(texts))
    condition = ("", PROMPTS[0], "") if is_text(model) else ("1", "", "")  # class, prompt, negative prompt
    d = pipe.defaults
    sampling = (d["guidance_scale"], d["temperature"], d["top_k"] or 0, d["top_p"])
    ar, fast_image, summary, heatmap, commit_pass, stats = compare(cache, model, *condition, fast, 3, *sampling, fields)
    assert stats["ar"]["method"] == reference and stats["method"]["method"] == fast
    assert ar.size == fast_image.size and min(ar.size) >= 256 and heatmap.width > 0
    assert f"| {fast} |" in summary.splitlines()[0]
