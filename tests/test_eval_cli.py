"""`visar eval shapes` and `visar bench` end to end on the random embedded model (mechanics, not quality)."""

import json

import numpy as np
import pytest

import visar
from visar.apps.cli import main
from visar.eval.bench import frechet_distance
from visar.eval.shapes_eval import caption_metadata, evaluate_shapes, ground_truth_scores


def test_frechet_distance_basics():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2000, 4))
    b = rng.normal(size=(2000, 4))
    assert frechet_distance(a, a) == pytest.approx(0, abs=1e-6)
    assert frechet_distance(a, b) < 0.05
    assert frechet_distance(a, b + 1.0) == pytest.approx(4.0, rel=0.1)  # |mu_a - mu_b|^2 = 4


def test_eval_shapes_json(tmp_path):
    path = tmp_path / "score.json"
    assert (
        main(["eval", "shapes", "--model", "visar-tiny-random", "--n", "4", "--batch-size", "2", "--json", str(path)])
        == 0
    )
    record = json.loads(path.read_text())
    assert set(record) == {"model", "method", "n", "accuracy"} and record["n"] == 4
    assert 0 <= record["accuracy"] <= 1


def test_eval_shapes_is_batch_invariant():
    pipe = visar.load("visar-tiny-random", device="cpu")
    # the random model's images are noise: the score is a deterministic function of the seeds
    a = evaluate_shapes(pipe, n=3, batch_size=1, progress=False)
    b = evaluate_shapes(pipe, n=3, batch_size=3, progress=False)
    assert a == b


def test_caption_metadata_interleaves_tasks_and_ground_truth_scores():
    metadata = caption_metadata(12)
    assert [m["tag"] for m in metadata[:6]] == [
        "single_object",
        "two_object",
        "counting",
        "colors",
        "position",
        "color_attr",
    ]
    assert ground_truth_scores(12, class_conditional=False)["overall"] == 1.0
    assert ground_truth_scores(8, class_conditional=True)["accuracy"] == 1.0


def test_bench_table_and_json(tmp_path, capsys):
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    assert (
        main(
            [
                "bench",
                "--model",
                "visar-tiny-random",
                "--n",
                "2",
                "--quality-n",
                "4",
                "--json",
                str(js),
                "--md",
                str(md),
            ]
        )
        == 0
    )
    report = json.loads(js.read_text())
    row = report["rows"][0]
    assert row["method"] == "ar" and row["lossless"] and row["forward_passes"] == 256
    assert row["step_compression"] == 1.0 and row["latency_ratio_vs_ar"] == 1.0
    assert set(row) == {
        "method",
        "lossless",
        "forward_passes",
        "tokens_per_forward",
        "step_compression",
        "latency_ratio_vs_ar",
        "images_per_s",
        "peak_mem_mb",
        "detector_accuracy",
        "frechet_vs_ar",
    }
    assert "| ar | yes | 256.0" in md.read_text() and "| ar | yes" in capsys.readouterr().out


def test_bench_bad_options():
    assert main(["bench", "--methods", "nope"]) == 2
    assert main(["bench", "--opt", "window=3"]) == 2
    assert main(["bench", "--opt", "ar.window=3"]) == 2
