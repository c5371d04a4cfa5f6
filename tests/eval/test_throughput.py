"""`visar bench --throughput` (`visar.eval.throughput`): rows of fixed and running batches per method and
batch size, what each feeds per image against its images alone, and the command's table and JSON."""

import json

import pytest
from laws import tiny_pipeline


@pytest.mark.slow  # about 16 s: every row runs warm-up, timed and memory-counted decodes
def test_bench_throughput_rows_and_command(tmp_path, capsys):
    from visar.apps import cli
    from visar.eval.throughput import throughput, throughput_table

    pipe = tiny_pipeline("llamagen")
    report = throughput(pipe, ["mc-sjd"], batch_sizes=(1, 3), images_per_slot=3, progress=False)
    rows = {(r["method"], r["batch_size"], r["refill"]): r for r in report["rows"]}
    assert set(rows) == {
        ("ar", 1, False),
        ("ar", 3, False),
        ("mc-sjd", 1, False),
        ("mc-sjd", 3, False),
        ("mc-sjd", 3, True),
    }
    assert rows[("ar", 3, False)]["passes_fed_per_image"] == pipe.model.num_image_tokens
    assert rows[("mc-sjd", 1, False)]["passes_vs_alone"] == 1.0
    # a fixed batch feeds its finished images' rows until its slowest is done; a running batch refills them
    fixed, running = rows[("mc-sjd", 3, False)], rows[("mc-sjd", 3, True)]
    assert fixed["passes_alone_per_image"] == running["passes_alone_per_image"]
    assert 1.0 <= running["passes_fed_per_image"] <= fixed["passes_fed_per_image"]
    assert all(r["peak_mem_mb"] > 0 and r["images_per_s"] > 0 for r in report["rows"])
    assert "| mc-sjd | 3 | yes | 1 |" in throughput_table(report)

    out = tmp_path / "throughput.json"
    args = ["bench", "--model", "visar-tiny-random", "--methods", "sjd", "--throughput", "--batch-sizes", "2"]
    assert cli.main([*args, "--images-per-slot", "1", "--json", str(out), "--deterministic"]) == 0
    printed = capsys.readouterr().out
    assert "| sjd | 2 | yes |" in printed and "| sjd | 2 | alone (deterministic) |" in printed
    alone = [r for r in json.loads(out.read_text())["rows"] if r["alone"]]
    assert [(r["method"], r["batch_size"]) for r in alone] == [("ar", 2), ("sjd", 2)]
    assert all(r["passes_vs_alone"] == 1.0 and r["speed_vs_fixed"] > 0 for r in alone)  # it feeds no padding
    assert cli.main([*args, "--batch-sizes", "two"]) == 2
