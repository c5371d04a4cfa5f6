"""`visar bench --sweep`: one method over several option values, a table row per value and a PNG plot."""

import json

import pytest
from PIL import Image

from visar.apps.cli import main
from visar.errors import VisarError
from visar.eval.plots import nice_ticks, plot_sweep
from visar.eval.sweep import parse_sweep


@pytest.mark.slow  # a bench per swept value, with its quality columns
def test_sweep_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))
    png, js = tmp_path / "sweep.png", tmp_path / "sweep.json"
    args = ["bench", "--model", "visar-tiny-random", "--methods", "gsd", "--sweep", "group_size=1,14"]
    args += ["--opt", "gsd.max_distance=4"]
    assert main([*args, "--n", "1", "--quality-n", "3", "--plot", str(png), "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    assert [r["method"] for r in report["rows"]] == ["ar", "gsd group_size=1", "gsd group_size=14"]
    assert [r.get("group_size") for r in report["rows"]] == [None, 1, 14]
    assert report["sweep"] == {
        "method": "gsd",
        "option": "group_size",
        "values": [1, 14],
        "options": {"max_distance": 4},
    }
    assert all(r["frechet_vs_ar"] is not None and r["step_compression"] >= 1 for r in report["rows"])
    assert report["settings"]["options"] == {"ar": {}}
    # the random model has no class names, so only the Frechet panel is drawn
    with Image.open(png) as image:
        assert image.size == (520, 470) and image.format == "PNG"
        assert image.convert("L").getextrema() == (0, 255)  # black marks on white
    assert "| gsd group_size=14 | no |" in capsys.readouterr().out


def test_plot_has_one_panel_per_quality_column(tmp_path):
    rows = [
        {"method": "ar", "step_compression": 1.0, "detector_accuracy": 0.9, "frechet_vs_ar": 0.2},
        {
            "method": "lantern delta=0",
            "delta": 0,
            "step_compression": 2.1,
            "detector_accuracy": 0.9,
            "frechet_vs_ar": 0.21,
        },
        {
            "method": "lantern delta=0.1",
            "delta": 0.1,
            "step_compression": 2.6,
            "detector_accuracy": 0.85,
            "frechet_vs_ar": 0.4,
        },
    ]
    report = {
        "model": "m",
        "settings": {"quality_n": 8},
        "rows": rows,
        "sweep": {"method": "lantern", "option": "delta", "values": [0, 0.1]},
    }
    with Image.open(plot_sweep(report, tmp_path / "p.png")) as image:
        assert image.size == (1040, 470)
    for row in rows:
        row["detector_accuracy"] = row["frechet_vs_ar"] = None
    with pytest.raises(VisarError, match="nothing to plot"):
        plot_sweep(report, tmp_path / "q.png")


def test_parse_sweep_and_ticks():
    assert parse_sweep("delta=0,0.05, 0.1") == ("delta", [0, 0.05, 0.1])
    assert parse_sweep("form=paper,bounded") == ("form", ["paper", "bounded"])
    assert parse_sweep("group-size=1") == ("group_size", [1])
    for bad in ("delta", "=1,2", "delta="):
        with pytest.raises(VisarError, match="--sweep"):
            parse_sweep(bad)
    assert nice_ticks(1.0, 3.7) == [1.0, 2.0, 3.0, 4.0]
    assert nice_ticks(0.61, 0.64) == [0.61, 0.62, 0.63, 0.64]
    assert nice_ticks(0.5, 0.5)[0] < 0.5 < nice_ticks(0.5, 0.5)[-1]


def test_sweep_bad_input():
    assert main(["bench", "--methods", "gsd,lantern", "--sweep", "delta=0,0.1"]) == 2
    assert main(["bench", "--methods", "lantern", "--sweep", "delta"]) == 2
    assert main(["bench", "--methods", "lantern", "--sweep", "delta=0,0.1", "--quality-n", "0"]) == 2
    assert main(["bench", "--methods", "ar", "--sweep", "window=1", "--quality-n", "2"]) == 2
