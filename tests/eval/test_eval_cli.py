"""`visar eval shapes` and `visar bench` end to end on the random embedded model (mechanics, not quality)."""

import json
import warnings

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

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


@pytest.mark.one_thread  # scores of batch 1 and batch 3, equal to the bit
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
                "--device",
                str(TEST_DEVICE),
                "--n",
                "2",
                "--quality-n",
                "4",
                "--json",
                str(js),
                "--md",
                str(md),
                "--report",
                str(tmp_path / "report"),
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["frontier.png", "report.json", "report.md"]
    report = json.loads(js.read_text())
    row = report["rows"][0]
    assert row["method"] == "ar" and row["lossless"] and row["forward_passes"] == 256
    assert row["step_compression"] == 1.0 and row["latency_ratio_vs_ar"] == 1.0
    assert set(row) == {
        "method",
        "options",
        "lossless",
        "forward_passes",
        "draft_forward_passes",
        "tokens_per_forward",
        "step_compression",
        "latency_ratio_vs_ar",
        "images_per_s",
        "peak_mem_mb",
        "detector_accuracy",
        "geneval_overall",  # None for a class-conditional model; per-task scores only for a text model
        "frechet_vs_ar",
        "ms_per_forward",
        "warmup_s",
        "compiled",
        "acceptance_rate",
        "acceptance_by_row",
        "acceptance_by_slot",
        "read_backs_per_pass",
        "read_backs_by_kind",
        "ops_per_pass",
    }
    assert row["acceptance_rate"] is None and row["ms_per_forward"] > 0  # AR drafts nothing
    assert row["compiled"] is False and row["warmup_s"] > 0
    assert 0 < row["peak_mem_mb"] < 100  # one batch's decode, the weights excluded
    assert row["acceptance_by_row"] == [None] * 16 and row["acceptance_by_slot"] == []
    assert "| ar | yes | 256.0 | 1.00 |" in md.read_text() and "| ar | yes" in capsys.readouterr().out
    assert "step compression" in md.read_text().splitlines()[0]


def test_tensor_memory_counts_what_the_block_allocates_and_frees():
    from visar.eval.memory import PeakMemory, TensorMemory

    before = torch.zeros(1000, 1000)  # held before the block: not counted, nor its views
    with TensorMemory() as memory:
        a = torch.ones(1000, 1000)  # 4 MB
        b = a * 2  # 8 MB alive
        del a
        c = b + before.t()  # 8 MB alive again (a was freed)
        c += 1  # in place: nothing new
        del b, c
        d = torch.empty(3_000_000)  # 12 MB, the peak
        view = d[:10]
        del d
        assert memory.bytes == 12_000_000  # the view keeps d's storage alive
        del view
    assert memory.peak_bytes == 12_000_000 and memory.bytes == 0
    with PeakMemory(torch.device("cpu")) as peak:
        torch.ones(2**20 // 4)
    assert peak.peak_mb == 1.0
    with PeakMemory(torch.device("cpu"), count_tensors=False) as peak:
        torch.ones(10)
    assert peak.peak_mb is None


def synthetic_report():
    def row(method, lossless, passes, ratio, accuracy, frechet):
        return {
            "method": method,
            "lossless": lossless,
            "forward_passes": passes,
            "tokens_per_forward": 256 / passes,
            "step_compression": 256 / passes,
            "latency_ratio_vs_ar": ratio,
            "images_per_s": 1 / ratio,
            "peak_mem_mb": 500.0,
            "detector_accuracy": accuracy,
            "frechet_vs_ar": frechet,
        }

    rows = [
        row("ar", True, 256, 1.0, 0.50, 3.0),
        row("sjd", True, 100, 0.8, 0.51, 3.1),
        row("zipar", False, 76, 0.4, 0.30, 9.0),
        row("slow-lossy", False, 200, 1.5, 0.20, 12.0),
    ]
    settings = {"n": 8, "batch_size": 1, "quality_n": 100, "device": "cpu", "dtype": "float32", "sampling": {}}
    return {"model": "m", "settings": settings, "rows": rows}


def test_bench_report_folder(tmp_path):
    from PIL import Image

    from visar.eval.bench import write_bench_report

    files = write_bench_report(synthetic_report(), tmp_path / "report")
    md = files["md"].read_text()
    assert "| zipar | no | 76.0 | 3.37 |" in md and "| sjd | yes | 100.0 | 2.56 |" in md
    assert "Lossless methods (yes)" in md and "(frontier.png)" in md
    assert json.loads(files["json"].read_text())["rows"][2]["lossless"] is False
    with Image.open(files["png"]) as image:  # 2 speed axes x 2 quality columns
        assert image.size == (1040, 60 + 2 * 440)
    no_quality = synthetic_report()
    for r in no_quality["rows"]:
        r["detector_accuracy"] = r["frechet_vs_ar"] = None
    with Image.open(write_bench_report(no_quality, tmp_path / "speed")["png"]) as image:
        assert image.size == (520, 60 + 440)


def test_pareto_front():
    from visar.eval.plots import pareto_front

    points = [(2.0, 0.5, "a"), (3.0, 0.4, "b"), (1.0, 0.6, "c"), (1.5, 0.45, "d"), (3.0, 0.3, "e"), (0.5, 0.1, "f")]
    assert pareto_front(points, lower_is_better=False) == [2, 0, 1]  # d is beaten by a, e by b, f by c
    assert pareto_front(points, lower_is_better=True) == [5, 4]  # e beats a, b, c and d; none beats f on y


def test_compile_option_on_every_generating_command(monkeypatch):
    from visar.apps.cli import build_parser, load_pipeline

    parser = build_parser()
    for command in (["generate"], ["bench"], ["eval", "shapes"], ["eval", "fid", "--out", "x"]):
        assert parser.parse_args([*command, "--compile"]).compile is True
        assert parser.parse_args(command).compile is False
    assert parser.parse_args(["eval", "geneval", "--out", "x", "--no-compile", "--dtype", "bf16"]).dtype == "bf16"
    compiled = []
    monkeypatch.setattr(visar.pipeline.Pipeline, "compile", lambda self, **kw: compiled.append(self.name) or self)
    args = parser.parse_args(["eval", "shapes", "--model", "visar-tiny-random", "--device", "cpu", "--compile"])
    assert load_pipeline(args).name == "visar-tiny-random" and compiled == ["visar-tiny-random"]


def test_compiled_pipeline_generates_the_same_images():
    pipe = visar.load("visar-tiny-random", device="cpu")
    eager = pipe.generate(class_labels=[3, 5], seed=1, output_type="tokens").tokens
    compiled = pipe.compile(backend="eager").generate(class_labels=[3, 5], seed=1, output_type="tokens").tokens
    assert torch.equal(eager, compiled)


def no_compiler(graph_module, example_inputs):
    """A torch.compile backend standing in for a platform where compiling fails (no C++ compiler)."""
    raise RuntimeError("no C++ compiler on this platform")


def test_compile_failure_warns_once_and_runs_eagerly(monkeypatch):
    """torch.compile fails lazily, at the first call: that call and every later one run eagerly."""
    pipe = visar.load("visar-tiny-random", device="cpu")
    eager = pipe.generate(class_labels=[3, 5], seed=1, method="sjd", output_type="tokens").tokens
    calls = []
    forward = type(pipe.model).forward
    monkeypatch.setattr(type(pipe.model), "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    pipe.compile(backend=no_compiler)
    with pytest.warns(RuntimeWarning, match="torch.compile failed on this platform.*no C.. compiler.*runs eagerly"):
        out = pipe.generate(class_labels=[3, 5], seed=1, method="sjd", output_type="tokens")
    assert torch.equal(out.tokens, eager)
    assert "forward" not in pipe.model.__dict__  # the module's own forward again, not the compiled one
    assert len(calls) == out.stats["forward_passes"]  # each pass ran eagerly once (the failed call traced only)


def test_compile_failure_from_the_command_line(monkeypatch, tmp_path):
    from visar.apps.cli import main as cli

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": no_compiler}))
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        code = cli(["generate", "--model", "visar-tiny-random", "--device", "cpu", "--compile", "--out", str(tmp_path)])
    assert code == 0 and list(tmp_path.glob("*.png"))


def test_a_model_error_under_compile_is_the_model_s():
    """An error that eager mode raises as well is the model's: raised, not blamed on the compiler."""
    pipe = visar.load("visar-tiny-random", device="cpu").compile(backend=no_compiler)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(Exception) as error:
        warnings.simplefilter("always")
        pipe.model(torch.full((1, 1), 10**6), torch.tensor([0]), input_pos=torch.arange(2))  # no such token id
    assert "torch.compile" not in str(error.value) and not caught
    assert isinstance(pipe.model.__dict__.get("forward"), visar.pipeline.EagerFallback)  # still compiled


def test_bench_bad_options():
    assert main(["bench", "--methods", "nope"]) == 2
    assert main(["bench", "--opt", "window=3"]) == 2
    assert main(["bench", "--opt", "ar.window=3"]) == 2
    assert main(["bench", "--methods", "sjd", "--opt", "mc-sjd.window=3"]) == 2  # a method not run


def test_bench_options_reach_methods_with_dashes(monkeypatch):
    """METHOD.KEY=VALUE keeps the method's dashes (zipar-mc-sjd) and normalises only the key."""
    import visar.eval.bench as bench_module

    seen = {}

    def fake_bench(pipe, methods, **kw):
        seen.update(kw["method_options"])
        return {"model": "m", "settings": {}, "rows": []}

    monkeypatch.setattr(bench_module, "bench", fake_bench)
    monkeypatch.setattr(bench_module, "markdown_table", lambda report: "")
    args = ["bench", "--model", "visar-tiny-random", "--methods", "zipar-mc-sjd,sjd"]
    assert main([*args, "--opt", "zipar-mc-sjd.s=2", "--opt", "zipar-mc-sjd.cross-row=false"]) == 0
    assert seen == {"zipar-mc-sjd": {"s": 2, "cross_row": False}}


def test_jacobi_passes_keep_to_a_few_shapes():
    """Windows are padded to 1, 2, 4, 8 or 16 slots, so a compiled model compiles each once, not once per
    length the end of an image leaves (an image of 256 tokens ends with windows of every length)."""
    pipe = visar.load("visar-tiny-random", device=TEST_DEVICE)
    lengths = []
    forward = pipe.model.forward
    pipe.model.forward = lambda tokens=None, cond=None, **kw: (
        lengths.append((0 if tokens is None else tokens.shape[1], cond is not None)) or forward(tokens, cond, **kw)
    )
    out = pipe.generate(class_labels=[3, 5, 7], seed=1, method="mc-sjd", window=16, output_type="tokens")
    del pipe.model.forward
    window_lengths = {length for length, with_condition in lengths if not with_condition}
    assert window_lengths <= {1, 2, 4, 8, 16} and 16 in window_lengths
    assert len(lengths) == out.stats["forward_passes"]


@pytest.mark.slow  # torch.compile of every row's shapes: too slow for the quick tier
def test_bench_compiled_rows():
    """--compiled-rows: every method again under torch.compile, marked, its warm-up apart, ratios against eager AR."""
    from visar.eval.bench import bench, markdown_table

    pipe = visar.load("visar-tiny-random", device=TEST_DEVICE)
    report = bench(pipe, ["sjd"], n=2, progress=False, compiled_rows=True, compile_kwargs={"backend": "eager"})
    rows = report["rows"]
    assert [(r["method"], r["compiled"]) for r in rows] == [("ar", False), ("sjd", False), ("ar", True), ("sjd", True)]
    assert rows[0]["latency_ratio_vs_ar"] == 1.0 and all(r["warmup_s"] > 0 for r in rows)
    assert rows[1]["forward_passes"] == rows[3]["forward_passes"]  # the same tokens, compiled or not
    assert pipe.is_compiled and "ar (compiled, warm-up" in markdown_table(report)


@pytest.mark.slow  # quality columns: 12 images per row, each scored
def test_bench_scores_a_text_conditional_model_by_geneval_task(monkeypatch):
    """A t2i model's quality columns: the GenEval-style overall score and per-task accuracies, the
    detector's verdict on each image against its own prompt's metadata (stubbed here to 'correct
    only for single_object prompts', so the scores are known)."""
    import visar.eval.detector as detector
    from visar.eval.bench import bench, markdown_table

    verdicts = []

    def only_single_objects(found, entry):
        verdicts.append(entry["tag"])
        return entry["tag"] == "single_object", ""

    monkeypatch.setattr(detector, "score_geneval", only_single_objects)
    pipe = visar.load("visar-tiny-t2i", device=TEST_DEVICE)
    report = bench(pipe, ["zipar"], n=2, quality_n=12, progress=False, method_options={"zipar": {"s": 3}})
    for row in report["rows"]:
        assert row["geneval_tasks"]["single_object"] == 1.0 and row["geneval_tasks"]["color_attr"] == 0.0
        assert row["geneval_overall"] == pytest.approx(1 / 6) and row["detector_accuracy"] is None
    assert verdicts.count("position") == 4  # 12 images, 6 tasks interleaved, two rows
    table = markdown_table(report)
    assert "| GenEval overall |" in table and "| single_object | two_object |" in table
