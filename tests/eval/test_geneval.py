"""`visar eval geneval`: GenEval's layout, per-image seeds, resume, metadata checks and shapes-world scoring."""

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

import visar
from visar.apps.cli import main
from visar.data.shapes import TASKS, render_from_metadata
from visar.errors import VisarError
from visar.eval.geneval import (
    SHIPPED_METADATA,
    evaluate_geneval,
    format_summary,
    load_metadata,
    make_shapes_metadata,
    score_layout,
    summary,
)
from visar.eval.samples import one_cpu_thread

ONE_PER_TASK = [
    {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"},
    {
        "tag": "two_object",
        "include": [{"class": "square", "count": 1}, {"class": "cross", "count": 1}],
        "prompt": "a photo of a square and a cross",
    },
    {
        "tag": "counting",
        "include": [{"class": "triangle", "count": 2}],
        "exclude": [{"class": "triangle", "count": 3}],
        "prompt": "a photo of two triangles",
    },
    {
        "tag": "colors",
        "include": [{"class": "circle", "count": 1, "color": "red"}],
        "prompt": "a photo of a red circle",
    },
    {
        "tag": "position",
        "include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a circle left of a square",
    },
    {
        "tag": "color_attr",
        "include": [{"class": "cross", "count": 1, "color": "blue"}, {"class": "square", "count": 1, "color": "pink"}],
        "prompt": "a photo of a blue cross and a pink square",
    },
]


def write_jsonl(path, entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


@pytest.fixture(scope="module")
def t2i():
    return visar.load("visar-tiny-t2i", device="cpu")


def test_shipped_metadata_is_the_documented_prompt_set():
    entries = load_metadata(SHIPPED_METADATA)
    assert entries == make_shapes_metadata(20, 0) == load_metadata()
    counts = {tag: sum(e["tag"] == tag for e in entries) for tag in TASKS}
    assert counts == {
        "single_object": 4,
        "two_object": 12,
        "counting": 12,
        "colors": 20,
        "position": 20,
        "color_attr": 20,
    }
    assert len({json.dumps(e, sort_keys=True) for e in entries}) == len(entries)  # no repeats


@pytest.mark.parametrize(
    "line, problem",
    [
        ("not json", "line 2 is not valid GenEval metadata: not JSON"),
        ("[1, 2]", "line 2 .*a JSON object is expected"),
        ('{"tag": "colors", "prompt": "a photo"}', "line 2 .*'include' must be a non-empty list"),
        ('{"tag": "x", "prompt": "p", "include": [{"class": "circle", "count": 0}]}', "line 2 .*count.* >= 1"),
        ('{"tag": "x", "prompt": "p", "include": [{"count": 1}]}', "line 2 .*needs a 'class' string"),
        (
            '{"tag": "position", "prompt": "p", "include": [{"class": "a", "count": 1, "position": ["left of", 0]}]}',
            "line 2 .*earlier include entry",
        ),
        (
            '{"tag": "x", "prompt": "p", "include": [{"class": "a", "count": 1}, '
            '{"class": "b", "count": 1, "position": ["beside", 0]}]}',
            "line 2 .*relation one of",
        ),
        ("", "line 2 is not valid GenEval metadata: not JSON"),
    ],
)
def test_invalid_metadata_lines_are_named(tmp_path, line, problem):
    path = tmp_path / "meta.jsonl"
    path.write_text(json.dumps(ONE_PER_TASK[0]) + "\n" + line + "\n" + json.dumps(ONE_PER_TASK[1]) + "\n")
    with pytest.raises(VisarError, match=problem):
        load_metadata(path)
    assert main(["eval", "geneval", "--model", "visar-tiny-t2i", "--metadata", str(path), "--out", str(tmp_path)]) == 2


@pytest.mark.one_thread  # a resumed run's files, byte for byte
@pytest.mark.slow  # the whole command twice: generation and the detector's scoring
def test_layout_seeds_resume_and_score(t2i, tmp_path, monkeypatch, capsys):
    meta = write_jsonl(tmp_path / "meta.jsonl", ONE_PER_TASK[:3])
    out = tmp_path / "geneval"
    args = ["eval", "geneval", "--model", "visar-tiny-t2i", "--metadata", str(meta), "--out", str(out)]
    # batch size 1: an image remade in another batch can differ where a draw is a near-tie that the
    # batch shape's rounding flips (visar/eval/samples.py; it happened here with batches of 4 and 2)
    args += ["--n-samples", "2", "--seed", "10", "--batch-size", "1", "--device", "cpu", "--no-compile"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "3 prompts x 2 images" in printed and "Overall score (avg. over tasks):" in printed

    # GenEval's layout: digit folders, metadata.jsonl = one JSON object (json.load), samples/\d+.png
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["00000", "00001", "00002"]
    for i, entry in enumerate(ONE_PER_TASK[:3]):
        folder = out / f"{i:05d}"
        with open(folder / "metadata.jsonl") as file:
            assert json.load(file) == entry
        assert sorted(p.name for p in (folder / "samples").iterdir()) == ["00000.png", "00001.png"]
        assert all(re.match(r"\d+\.png", p.name) for p in (folder / "samples").iterdir())

    # image j of prompt i: seed SEED + i * n_samples + j, generated alone
    prompt = ONE_PER_TASK[2]["prompt"]
    with one_cpu_thread():  # sample sets are decoded on one CPU thread (visar.eval.samples)
        alone = t2i.generate(
            prompts=[prompt], generator=torch.Generator().manual_seed(10 + 2 * 2 + 1), output_type="np"
        )
    np.testing.assert_array_equal(np.asarray(Image.open(out / "00002" / "samples" / "00001.png")), alone.images[0])

    # GenEval's results rows and summary
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and set(rows[0]) == {"filename", "tag", "prompt", "correct", "reason", "metadata", "details"}
    record = json.loads((out / "summary.json").read_text())
    s = record["summary"]
    assert s["images"] == 6 and s["prompts"] == 3
    assert s["overall"] == pytest.approx(np.mean(list(s["tasks"].values())))

    # resume: a lost and a truncated image are made again, identically; nothing else is touched
    lost, cut = out / "00000" / "samples" / "00001.png", out / "00001" / "samples" / "00000.png"
    lost_bytes, cut_bytes = lost.read_bytes(), cut.read_bytes()
    lost.unlink()
    cut.write_bytes(cut_bytes[:100])
    others = {p: p.stat().st_mtime_ns for p in out.glob("*/samples/*.png") if p != cut}
    calls = []
    real_generate = visar.pipeline.Pipeline.generate

    def counting_generate(self, *a, **kw):
        calls.append(len(kw["prompts"]))
        return real_generate(self, *a, **kw)

    monkeypatch.setattr(visar.pipeline.Pipeline, "generate", counting_generate)
    assert main(args) == 0
    assert sum(calls) == 2 and lost.read_bytes() == lost_bytes and cut.read_bytes() == cut_bytes
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in others.items())
    assert "(2 generated, 4 already there)" in capsys.readouterr().out

    # another seed or another prompt file into the same folder is refused
    assert main([*args, "--seed", "11"]) == 2
    other = write_jsonl(tmp_path / "other.jsonl", ONE_PER_TASK[3:6])
    with pytest.raises(VisarError, match="holds images of another run .*metadata_sha256"):
        evaluate_geneval(t2i, out, metadata=other, n_samples=2, seed=10, progress=False)


@pytest.mark.slow  # whole CLI or eval runs: the quick tier keeps to 90 s
def test_a_negative_prompt_reaches_every_image_and_the_run_config(t2i, tmp_path, capsys):
    """--negative-prompt: every image is generated with it (image j of prompt i alone, same seed), the run's
    config.json records it, and resuming without it into the same folder is refused."""
    meta = write_jsonl(tmp_path / "meta.jsonl", ONE_PER_TASK[:2])
    out, negative = tmp_path / "geneval", "green triangle"
    args = ["eval", "geneval", "--model", "visar-tiny-t2i", "--metadata", str(meta), "--out", str(out), "--no-score"]
    args += ["--n-samples", "2", "--seed", "3", "--batch-size", "1", "--device", "cpu", "--guidance-scale", "4"]
    assert main([*args, "--negative-prompt", negative]) == 0
    assert json.loads((out / "config.json").read_text())["negative_prompt"] == negative
    prompt, seed = ONE_PER_TASK[1]["prompt"], 3 + 1 * 2 + 0
    kwargs = dict(prompts=[prompt], guidance_scale=4.0, output_type="np")
    with one_cpu_thread():
        alone = t2i.generate(negative_prompt=negative, generator=torch.Generator().manual_seed(seed), **kwargs)
        plain = t2i.generate(generator=torch.Generator().manual_seed(seed), **kwargs)
    image = np.asarray(Image.open(out / "00001" / "samples" / "00000.png"))
    np.testing.assert_array_equal(image, alone.images[0])
    assert not np.array_equal(image, plain.images[0])  # negative control: the null caption's image
    capsys.readouterr()
    assert main(args) == 2  # the same folder without the negative prompt: another run's images
    assert "negative_prompt" in capsys.readouterr().err


def test_scorer_on_ground_truth_renders(tmp_path):
    """Ground truth written into the layout scores 100% on every task; a blank image fails its prompt."""
    for i, entry in enumerate(ONE_PER_TASK):
        (tmp_path / f"{i:05d}" / "samples").mkdir(parents=True)
        for j in range(2):
            image = render_from_metadata(entry, seed=100 * i + j).image
            Image.fromarray(image).save(tmp_path / f"{i:05d}" / "samples" / f"{j:05d}.png")
    rows = score_layout(tmp_path, ONE_PER_TASK, 2)
    assert all(r["correct"] for r in rows) and summary(rows)["overall"] == 1.0
    Image.new("RGB", (64, 64), (128, 128, 128)).save(tmp_path / "00003" / "samples" / "00000.png")
    s = summary(score_layout(tmp_path, ONE_PER_TASK, 2))
    assert s["tasks"]["colors"] == 0.5 and s["correct_prompts"] == 1.0 and s["correct_images"] == pytest.approx(11 / 12)
    assert s["overall"] == pytest.approx((5 + 0.5) / 6)
    assert "colors           = 50.00% (1 / 2)" in format_summary(s)


def test_scoring_refuses_what_the_shapes_detector_cannot_read(t2i, tmp_path):
    coco = {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"}
    meta = write_jsonl(tmp_path / "coco.jsonl", [ONE_PER_TASK[0], coco])
    with pytest.raises(VisarError, match="line 2 names 'bench', not an object of the shapes world"):
        evaluate_geneval(t2i, tmp_path / "out", metadata=meta, progress=False)
    with pytest.raises(VisarError, match="class-conditional"):
        evaluate_geneval(visar.load("visar-tiny-random", device="cpu"), tmp_path / "out2", progress=False)
