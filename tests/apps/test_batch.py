"""`visar generate` as a batch tool: items files, resume, refusals, interruptions, torchrun.

The files of a run (PNGs, images.jsonl, settings.json) must not depend on the batch size, the
number of processes or interruptions; stats.json holds the run's timings and is left out of
every comparison.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import file_bytes
from PIL import Image

import visar
import visar.eval.samples
from visar.apps.cli import main
from visar.eval.samples import decode_alone

# every test compares files across batch sizes, resumes or world sizes byte for byte:
# at one torch thread, where that holds (tests/conftest.py, one_torch_thread)
pytestmark = pytest.mark.one_thread

MODEL = ["--model", "visar-tiny-random"]
TIMINGS = {"stats.json"}  # the run's own timings: left out of every comparison of its files


def generate(out: Path, *args: str) -> int:
    """`visar generate` with plain AR unless args name a method: the batch tool's guarantees (the same
    files at any batch size, on resume) hold for a fixed method; `auto` chooses for the batch size."""
    method = [] if "--method" in args else ["--method", "ar"]
    return main(["generate", *MODEL, "--quiet", "--out", str(out), *method, *args])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of 6 images, 3 class items given by name and id, 2 images each."""
    folder = tmp_path_factory.mktemp("batch") / "reference"
    items = folder.parent / "classes.txt"
    items.write_text("7\n\n12\n0\n")
    assert generate(folder, "--classes-file", str(items), "-n", "2", "--seed", "10", "--batch-size", "4") == 0
    return folder


def test_items_file_layout_records_and_settings(reference):
    names = sorted(file_bytes(reference, TIMINGS))
    assert names == [f"{g:05d}.png" for g in range(6)] + ["images.jsonl", "settings.json"]
    records = [json.loads(line) for line in (reference / "images.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(6))
    assert [r["class_label"] for r in records] == [7, 12, 0, 7, 12, 0]  # image g: item g mod 3
    assert [r["seed"] for r in records] == list(range(10, 16))
    assert {r["method"] for r in records} == {"ar"} and {r["forward_passes"] for r in records} == {256}
    settings = json.loads((reference / "settings.json").read_text())
    assert settings["items"] == [{"condition": 7}, {"condition": 12}, {"condition": 0}] and settings["seed"] == 10
    stats = json.loads((reference / "stats.json").read_text())
    assert stats["n"] == 6 and stats["generated"] == 6 and stats["images"] == records


def cli_image(folder: Path, g: int) -> np.ndarray:
    return np.asarray(Image.open(folder / f"{g:05d}.png").convert("RGB"))


def test_num_images_per_prompt_gives_the_cli_s_images(reference):
    """Pipeline.generate(num_images_per_prompt=2) on the reference's 3 class items: its image j of item i
    (at i * 2 + j) is the CLI's image g = j * 3 + i, same seed, same pixels."""
    pipe = visar.load("visar-tiny-random", device="cpu")
    labels = [7, 12, 0]
    out = pipe.generate(class_labels=labels, num_images_per_prompt=2, seed=10, method="ar", output_type="tokens")
    records = [json.loads(line) for line in (reference / "images.jsonl").read_text().splitlines()]
    for i, label in enumerate(labels):
        for j in range(2):
            g = j * 3 + i
            assert records[g]["class_label"] == label and records[g]["seed"] == 10 + g
            assert np.array_equal(decode_alone(pipe, out.tokens[i * 2 + j]), cli_image(reference, g)), (i, j)
    # negative control: the first item's two images differ (each has its own seed)
    assert not np.array_equal(cli_image(reference, 0), cli_image(reference, 3))


@pytest.mark.slow  # whole CLI or eval runs: the quick tier keeps to 90 s
def test_a_negative_prompt_through_the_cli(tmp_path):
    """--negative-prompt reaches every image (recorded in settings.json and each record), and the CLI's image
    j of prompt i is Pipeline.generate's with the same negative prompt and num_images_per_prompt."""
    prompts, negative, out = ["a red circle", "two blue squares"], "green triangle", tmp_path / "t2i"
    args = ["generate", "--model", "visar-tiny-t2i", "--quiet", "--out", str(out), "--method", "ar", "-n", "4"]
    args += ["--prompt", prompts[0], "--prompt", prompts[1], "--seed", "5", "--negative-prompt", negative]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "images.jsonl").read_text().splitlines()]
    assert [r["negative_prompt"] for r in records] == [negative] * 4
    assert json.loads((out / "settings.json").read_text())["negative_prompt"] == negative
    pipe = visar.load("visar-tiny-t2i", device="cpu")
    kwargs = dict(num_images_per_prompt=2, seed=5, method="ar", output_type="tokens")
    with_negative = pipe.generate(prompts=prompts, negative_prompt=negative, **kwargs)
    for i in range(2):
        for j in range(2):
            image = decode_alone(pipe, with_negative.tokens[i * 2 + j])
            assert np.array_equal(image, cli_image(out, j * 2 + i)), (i, j)
    # negative control: the model's own null caption gives other images
    assert not torch.equal(pipe.generate(prompts=prompts, **kwargs).tokens, with_negative.tokens)


@pytest.mark.slow  # whole CLI or eval runs: the quick tier keeps to 90 s
def test_a_prompts_file_gives_each_line_its_own_negative_prompt(tmp_path):
    """jsonl "negative_prompt": that line's images are made with it, the others with --negative-prompt (or
    the model's own); a batch never mixes images with and without one, each image is what generate makes
    alone with its seed and negative prompt, and the records and settings.json name them."""
    lines = [
        {"prompt": "a red circle", "negative_prompt": "green"},
        "two blue squares",
        {"prompt": "a red circle", "negative_prompt": "blue triangle", "folder": "blue"},
    ]
    items = tmp_path / "prompts.jsonl"
    items.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "own"
    args = ["generate", "--model", "visar-tiny-t2i", "--quiet", "--out", str(out), "--method", "ar"]
    assert main([*args, "--prompts-file", str(items), "-n", "2", "--seed", "2", "--batch-size", "4"]) == 0
    records = [json.loads(line) for line in (out / "images.jsonl").read_text().splitlines()]
    negatives = ["green", None, "blue triangle"] * 2
    assert [r.get("negative_prompt") for r in records] == negatives
    settings = json.loads((out / "settings.json").read_text())
    assert [item.get("negative_prompt") for item in settings["items"]] == negatives[:3]
    pipe = visar.load("visar-tiny-t2i", device="cpu")
    for record, negative in zip(records, negatives, strict=True):
        own = {} if negative is None else {"negative_prompt": negative}
        generator = torch.Generator().manual_seed(record["seed"])
        alone = pipe.generate(prompts=[record["prompt"]], generator=generator, method="ar", output_type="tokens", **own)
        image = np.asarray(Image.open(out / record["file"]).convert("RGB"))
        assert np.array_equal(decode_alone(pipe, alone.tokens[0]), image), record["file"]
    # --negative-prompt serves the line without one; the lines' own come first
    both = tmp_path / "both"
    run = [*args[:5], str(both), *args[6:], "--prompts-file", str(items), "--negative-prompt", "white"]
    assert main(run) == 0
    records = [json.loads(line) for line in (both / "images.jsonl").read_text().splitlines()]
    assert [r["negative_prompt"] for r in records] == ["green", "white", "blue triangle"]


def test_a_negative_prompt_on_a_class_model_is_refused_before_anything_is_written(tmp_path, last_error):
    out = tmp_path / "refused"
    assert generate(out, "--class", "3", "--negative-prompt", "blurry") == 2
    assert "is class-conditional: a negative prompt replaces the unconditional prompt" in last_error()
    assert not out.exists()
    items = tmp_path / "prompts.jsonl"  # a line's own empty negative prompt: visar's caption encoder has no words
    items.write_text(json.dumps({"prompt": "a red circle", "negative_prompt": " "}) + "\n")
    args = ["generate", "--model", "visar-tiny-t2i", "--quiet", "--out", str(out), "--prompts-file", str(items)]
    assert main(args) == 2
    assert "an empty negative prompt cannot be encoded by this model's caption encoder" in last_error()
    assert not out.exists()


def test_same_files_for_any_batch_size_and_for_inline_items(reference, tmp_path):
    """--class 7 12 0 --n 6 is the same set as the file with -n 2 per item, at batch size 1."""
    out = tmp_path / "inline"
    assert generate(out, "--class", "7", "12", "0", "--n", "6", "--seed", "10", "--batch-size", "1") == 0
    assert file_bytes(out, TIMINGS) == file_bytes(reference, TIMINGS)


def test_rerun_resumes_and_regenerates_what_has_no_record(reference, tmp_path, capsys):
    out = tmp_path / "again"
    items = tmp_path / "classes.jsonl"
    items.write_text('7\n{"class": 12}\n0\n')
    args = ("--classes-file", str(items), "-n", "2", "--seed", "10")
    assert generate(out, *args) == 0
    capsys.readouterr()
    assert generate(out, *args) == 0
    assert json.loads((out / "stats.json").read_text())["generated"] == 0
    (out / "00003.png").write_bytes((out / "00003.png").read_bytes()[:100])  # cut short
    (out / "images.jsonl").write_text((out / "images.jsonl").read_text().replace('"index": 4', '"index": -4'))
    assert generate(out, *args) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["generated"], stats["reused"]) == (2, 4)
    assert file_bytes(out, TIMINGS) == file_bytes(reference, TIMINGS)


def test_class_names_and_text_items(tmp_path):
    from visar import load

    names = load("visar-tiny-c2i", device="cpu").class_names
    items = tmp_path / "names.jsonl"
    items.write_text(json.dumps(names[3].upper()) + "\n" + json.dumps({"class": names[5], "folder": "five/a"}) + "\n")
    out = tmp_path / "named"
    args = ["generate", "--model", "visar-tiny-c2i", "--quiet", "--classes-file", str(items), "--out", str(out)]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "images.jsonl").read_text().splitlines()]
    assert [(r["class_label"], r["class_name"], r["file"]) for r in records] == [
        (3, names[3], "00000.png"),
        (5, names[5], "five/a/00001.png"),
    ]
    assert (out / "five" / "a" / "00001.png").is_file()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    out = tmp_path / "text"
    args = ["generate", "--model", "visar-tiny-t2i", "--quiet", "--prompts-file", str(prompts), "--out", str(out)]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "images.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["a red circle", "a blue square"]


@pytest.mark.parametrize(
    "content, suffix, message",
    [
        ("", ".txt", "holds no items"),
        ("\n  \n", ".txt", "holds no items"),
        ("3\n\nnot-a-class\n", ".txt", "line 3: 'not-a-class' is not a class of visar-tiny-random"),
        ("3\n40\n", ".txt", "line 2: class id 40 out of range"),
        ('3\n{"class": 2\n', ".jsonl", "line 2: not valid JSON"),
        ('{"klass": 2}\n', ".jsonl", 'line 1: expected {"class"'),
        ('3\n{"class": 2, "negative_prompt": "blurry"}\n', ".jsonl", 'line 2: expected {"class": ..., "folder"'),
        ("[1, 2]\n", ".jsonl", "line 1: expected a class id or class name"),
        ('{"class": 1, "folder": "../escape"}\n', ".jsonl", "line 1: folder '../escape' would write outside"),
        ('{"class": 1, "folder": "/tmp/abs"}\n', ".jsonl", "line 1: folder '/tmp/abs' is not a relative path"),
    ],
)
def test_bad_items_files_exit_2_with_the_line(tmp_path, last_error, content, suffix, message):
    items = tmp_path / f"items{suffix}"
    items.write_text(content)
    out = tmp_path / "out"
    assert generate(out, "--classes-file", str(items)) == 2
    assert message in last_error()
    assert not any(out.glob("*.png"))


def test_item_folder_through_a_symlink_out_of_the_folder_is_refused(tmp_path, last_error):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "link").symlink_to(elsewhere)
    items = tmp_path / "items.jsonl"
    items.write_text('{"class": 1, "folder": "link"}\n')
    assert generate(out, "--classes-file", str(items)) == 2
    assert "outside the output folder" in last_error()
    assert not any(elsewhere.iterdir())


def test_other_settings_into_the_same_folder_are_refused(reference, tmp_path, last_error):
    out = tmp_path / "copy"
    out.mkdir()
    for name, data in file_bytes(reference, TIMINGS).items():
        (out / name).write_bytes(data)
    before = file_bytes(out, TIMINGS)
    assert generate(out, "--class", "7", "12", "0", "--n", "6", "--seed", "11") == 2
    assert "holds images of another run (seed: 10 there, 11 now)" in last_error()
    assert generate(out, "--class", "7", "12", "0", "--n", "6", "--seed", "10", "--top-k", "5") == 2
    assert "holds images of another run (sampling:" in last_error()
    assert file_bytes(out, TIMINGS) == before


def test_a_folder_of_another_tool_is_refused(tmp_path, last_error):
    out = tmp_path / "old"
    out.mkdir()
    (out / "00000.png").write_bytes(b"not ours")
    assert generate(out, "--n", "2") == 2
    assert "already holds 00000.png but no settings.json" in last_error()
    assert (out / "00000.png").read_bytes() == b"not ours"


def test_unwritable_output_folder_exits_2(tmp_path, last_error):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert generate(blocker / "out", "--n", "1") == 2
    assert "cannot write" in last_error()


def test_an_output_folder_that_is_a_file_is_said_so_not_blamed_on_space(tmp_path, last_error):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "out"):
        assert generate(out, "--n", "1") == 2
        error = last_error()
        assert "a file stands where the output folder (or a folder in it) should be" in error, error
        assert "free space" not in error and "permissions" not in error
    assert blocker.read_text() == "x"


def test_a_run_that_made_no_image_does_not_refuse_the_corrected_command(tmp_path, last_error):
    out = tmp_path / "e2"
    assert generate(out, "--method", "nosuchmethod", "--n", "1") == 2
    assert "unknown method 'nosuchmethod'" in last_error()
    assert generate(out, "--method", "sjd", "--opt", "window=abc", "--n", "1") == 2
    assert "window" in last_error()
    assert generate(out, "--n", "1") == 0
    assert json.loads((out / "settings.json").read_text())["method"] == "ar"
    # once the folder holds an image (here one without its record, as a kill between the two leaves) it is refused
    (out / "images.jsonl").unlink()
    assert generate(out, "--method", "sjd", "--n", "1") == 2
    assert "holds images of another run (method: 'ar' there, 'sjd' now)" in last_error()


def test_a_full_disk_keeps_what_was_written_and_resumes(reference, tmp_path, monkeypatch, last_error):
    out = tmp_path / "full"
    items = tmp_path / "classes.txt"
    items.write_text("7\n12\n0\n")
    args = ("--classes-file", str(items), "-n", "2", "--seed", "10", "--batch-size", "2")
    real_save, calls = visar.eval.samples.save_png, []

    def save_until_full(array, path):
        calls.append(path)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_save(array, path)

    monkeypatch.setattr(visar.eval.samples, "save_png", save_until_full)
    assert generate(out, *args) == 2
    error = last_error()
    assert "No space left on device" in error and "rerun the same command to resume" in error
    assert sorted(p.name for p in out.glob("*.png")) == ["00000.png", "00001.png", "00002.png"]
    monkeypatch.setattr(visar.eval.samples, "save_png", real_save)
    assert generate(out, *args) == 0
    assert json.loads((out / "stats.json").read_text())["generated"] == 3
    assert file_bytes(out, TIMINGS) == file_bytes(reference, TIMINGS)


def run_module(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "visar", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},  # as this module's tests: one thread
    )


BATCH = ("generate", *MODEL, "--quiet", "--class", "1", "2", "3", "-n", "16", "--seed", "3", "--method", "sjd")


@pytest.fixture(scope="module")
def sjd_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sjd") / "reference"
    assert main([*BATCH, "--batch-size", "4", "--out", str(out)]) == 0
    return out


@pytest.mark.slow  # two fresh interpreters per case (about 10 s)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_killed_run_resumes_to_the_same_files(sjd_reference, tmp_path, sig):
    out = tmp_path / "killed"
    # A suite started in the background by a non-interactive shell (`nohup ... &`) ignores SIGINT, and
    # an ignored signal stays ignored across exec: the child would never see the ^C this test sends.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # reset to the default by exec
    try:
        process = run_module(*BATCH, "--batch-size", "3", "--out", str(out))  # sjd refills its 3 slots
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    deadline = time.monotonic() + 120
    while len(list(out.glob("*.png"))) < 4 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert process.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), err
    assert not (out / "images.jsonl").exists(), "the run finished before it was killed"
    if sig == signal.SIGINT:
        assert "visar: interrupted" in err and "Traceback" not in err
    assert 4 <= len(list(out.glob("*.png"))) < 16
    resumed = run_module(*BATCH, "--batch-size", "2", "--out", str(out))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert 0 < json.loads((out / "stats.json").read_text())["reused"] < 16
    assert file_bytes(out, TIMINGS) == file_bytes(sjd_reference, TIMINGS)


@pytest.mark.slow  # torchrun starts two interpreters (about 10 s)
def test_two_gloo_processes_write_the_files_of_one(sjd_reference, tmp_path):
    out = tmp_path / "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "visar"]
    result = subprocess.run(
        [*command, *BATCH, "--batch-size", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "stats.json").read_text())["processes"] == 2
    assert file_bytes(out, TIMINGS) == file_bytes(sjd_reference, TIMINGS)


def stop_after_pngs(monkeypatch, images: int):
    """A ^C as the (images + 1)-th PNG is written, as a user stops a run part-way."""
    real_save, calls = Image.Image.save, []

    def save(image, fp, *args, **kwargs):
        calls.append(fp)
        if len(calls) > images:
            raise KeyboardInterrupt
        return real_save(image, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)


@pytest.mark.slow  # six runs of auto, two of them tuning from an empty cache (40 s)
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "one-thread"])
@pytest.mark.parametrize("tuned_by", ["full", "part"])
def test_an_auto_run_resumed_writes_the_files_of_an_uninterrupted_one(deterministic, tuned_by, tmp_path, monkeypatch):
    """Issue 68's commands: `auto` (the default method) from an empty cache, one run whole and one
    stopped after 2 images and resumed, write the same bytes whichever run tuned: the run settles its
    choice before its first image and records it in settings.json, where a resume reads it. Before,
    the tuning run decoded its first images with each candidate in turn and the other with the winner."""
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))  # empty: the first run tunes
    classes = tmp_path / "classes.txt"
    classes.write_text("1\n2\n3\n")
    args = ["generate", "--model", "default", "--quiet", "--classes-file", str(classes), "--n", "4"]
    args += ["--deterministic"] if deterministic else []
    full, part = tmp_path / "full", tmp_path / "part"

    def cut_and_resume():
        with monkeypatch.context() as stopped:
            stop_after_pngs(stopped, 2)
            assert main([*args, "--out", str(part)]) == 130
        assert len(list(part.glob("*.png"))) == 2
        assert main([*args, "--out", str(part)]) == 0

    if tuned_by == "part":
        cut_and_resume()
    assert main([*args, "--out", str(full)]) == 0
    if tuned_by == "full":
        cut_and_resume()
    assert file_bytes(full, TIMINGS) == file_bytes(part, TIMINGS)
    choice = json.loads((full / "settings.json").read_text())["auto_choice"]
    records = [json.loads(line) for line in (full / "images.jsonl").read_text().splitlines()]
    assert len(records) == 12 and {(r["method"], r["auto"]) for r in records} == {("auto", choice)}


@pytest.mark.slow  # torchrun starts two interpreters, which tune auto from an empty cache (about 20 s)
def test_two_gloo_processes_running_auto_write_the_files_of_one(tmp_path):
    """A torchrun world settles auto once (process 0 tunes, every process decodes with its choice),
    and a later one-process run, the tuning then kept, writes the same files."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VISAR_CACHE": str(tmp_path / "cache")}
    args = ["generate", "--model", "default", "--quiet", "--class", "1", "2", "3", "-n", "4", "--deterministic"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "visar"]
    world = subprocess.run(
        [*command, *args, "--out", str(tmp_path / "world")], capture_output=True, text=True, timeout=600, env=env
    )
    assert world.returncode == 0, world.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "visar", *args, "--out", str(tmp_path / "one")], capture_output=True, text=True,
        timeout=600, env=env,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    assert json.loads((tmp_path / "world" / "stats.json").read_text())["processes"] == 2
    assert "auto_choice" in json.loads((tmp_path / "one" / "settings.json").read_text())
    assert file_bytes(tmp_path / "world", TIMINGS) == file_bytes(tmp_path / "one", TIMINGS)
