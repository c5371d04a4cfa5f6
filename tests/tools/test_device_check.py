"""tools/device_check.sh --dry-run: the GPU check's steps on the CPU at tiny sizes, so the script that
a rare GPU loan runs in one call cannot rot unnoticed."""

import json
import subprocess

import pytest
from conftest import REPO


@pytest.mark.slow  # about 40 s of CPU, two minutes of wall time on a busy 2-core machine
def test_device_check_dry_run(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run(
        [str(REPO / "tools" / "device_check.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "device_check.json").read_text())
    assert report["dry_run"] is True
    assert [t["name"] for t in report["suite"]] == ["suite-fp32", "suite-bf16", "exact-law", "lumina-bf16"]
    assert all(t["rc"] == 0 and "passed" in t["summary"] for t in report["suite"]), report["suite"]
    cells = {(r["mode"], r["batch"], r["method"]) for r in report["bench"] if "method" in r}
    methods = ("ar", "sjd", "mc-sjd", "mc-sjd, budget 8", "auto", "zipar")  # rows named by their budget
    expected = {("eager", b, m) for b in (1, 2) for m in methods}
    assert expected | {("reduce-overhead", 1, "ar"), ("reduce-overhead", 1, "sjd")} == cells
    for row in report["bench"]:
        assert row["ms_per_pass"] > 0 and row["latency_over_ar"] > 0 and row["read_backs_per_pass"] >= 0
        assert row["compile_fell_back_to_eager"] is False
    ar = [r for r in report["bench"] if r["method"] == "ar"]
    assert all(r["pass_over_ar_pass"] == 1.0 and r["read_backs_per_pass"] < 0.5 for r in ar)
    split = json.loads((out / "pass_split.json").read_text())  # the model's call against the rest of a pass
    assert [r["method"] for r in split["rows"]] == ["ar", "mc-sjd"]
    assert all(r["model_ms_per_pass"] > 0 and r["floor_over_ar"] > 0 for r in split["rows"])
    deterministic = json.loads((out / "deterministic.json").read_text())  # bits across batches, with and without
    assert [r["deterministic"] for r in deterministic["rows"]] == [False, True]
    assert deterministic["rows"][1]["images_differing_from_alone"] == 0 and deterministic["rows"][1]["repeat_equal"]
    table = (out / "device_check.md").read_text()
    assert "| suite-bf16 | 0 |" in table and "| tiny | 0.04 | reduce-overhead | 1 | sjd |" in table
