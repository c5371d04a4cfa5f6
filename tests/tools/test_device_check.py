"""tools/device_check.sh --dry-run: the GPU check's steps on the CPU at tiny sizes, so the script that
a rare GPU loan runs in one call cannot rot unnoticed."""

import json
import subprocess

import pytest
from conftest import REPO

PROXY_METHODS = ("ar", "mc-sjd", "sjd-pac", "tree-mc-sjd", "auto")


@pytest.mark.slow  # about two and a half minutes on a busy 2-core machine
def test_device_check_dry_run(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run(
        [str(REPO / "tools" / "device_check.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=660,  # past the dry run's own budget (600 s), so that its deadlines, not this, end a slow run
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "device_check.json").read_text())
    assert report["dry_run"] is True
    # installed for the device's platform where .device_wheels was packed, else said to be absent
    assert report["wheels"].startswith(("rc 0: installed for CPython", "none: no .device_wheels")), report["wheels"]
    assert [t["name"] for t in report["suite"]] == ["suite-fp32", "suite-bf16", "exact-law", "lumina-bf16"]
    assert all(t["rc"] == 0 and "passed" in t["summary"] for t in report["suite"]), report["suite"]

    # the bench: every row measured (nothing skipped or failed), the proxy's first, in the planned order
    assert all("ms_per_pass" in r for r in report["bench"]), [r for r in report["bench"] if "ms_per_pass" not in r]
    proxy = [r for r in report["bench"] if r["table"] == "proxy"]
    cells = [
        (b, running, mode)
        for b, running in ((1, False), (2, False), (2, True))
        for mode in ("reduce-overhead", "eager")
    ]
    assert [(r["batch"], r["running"], r["mode"], r["method"]) for r in proxy] == [
        (*cell, m) for cell in cells for m in PROXY_METHODS
    ]
    assert report["bench"][: len(proxy)] == proxy
    others = [(r["model"], r["table"], r["mode"], r["method"]) for r in report["bench"][len(proxy) :]]
    assert others == [("tiny", "pass cost only", "eager", m) for m in ("ar", "mc-sjd", "zipar")]
    for row in report["bench"]:
        assert row["ms_per_pass"] > 0 and row["latency_over_ar"] > 0 and row["images_per_s"] > 0
        assert row["compile_fell_back_to_eager"] is False
        assert row["whole_passes"] is (row["mode"] != "eager")
        # a batch's passes run over all its slots: at least each image's own passes
        assert row["forward_passes"] >= row["passes_alone"] > 0
        # read-backs are counted in eager decodes only (a compiled row's would be its eager twin's)
        assert ("read_backs_per_pass" in row) is (row["mode"] == "eager")
        assert row["images"] == (4 if row["running"] else row["batch"])
    ar = [r for r in report["bench"] if r["method"] == "ar"]
    assert all(r["pass_over_ar_pass"] == 1.0 for r in ar)
    assert all(r["read_backs_per_pass"] < 0.5 for r in ar if r["mode"] == "eager")
    assert all(r["auto"] for r in proxy if r["method"] == "auto"), "auto's rows say what it ran"
    # a compiled fixed batch's warm-up is its timed call: every shape of pass compiled before the timing
    compiled_fixed = [r for r in proxy if r["mode"] != "eager" and not r["running"] and r["method"] in ("ar", "mc-sjd")]
    assert len(compiled_fixed) == 4 and all(r["graphs_compiled_in_timed_call"] == 0 for r in compiled_fixed)

    split = json.loads((out / "pass_split.json").read_text())  # the model's call against the rest of a pass
    assert [r["method"] for r in split["rows"]] == ["ar", "mc-sjd"]
    assert all(r["model_ms_per_pass"] > 0 and r["floor_over_ar"] > 0 for r in split["rows"])
    deterministic = json.loads((out / "deterministic.json").read_text())  # bits across batches, with and without
    assert [r["deterministic"] for r in deterministic["rows"]] == [False, True]
    assert deterministic["rows"][1]["images_differing_from_alone"] == 0 and deterministic["rows"][1]["repeat_equal"]

    table = (out / "device_check.md").read_text()
    sections = ["## Proxies, compiled", "## Proxies, eager", "## Tests", "## Other models"]
    assert [table.index(s) for s in sections] == sorted(table.index(s) for s in sections), "the compiled table first"
    assert "| tiny-proxy | 1.15 | reduce-overhead, whole passes | 2 running (4 images) | mc-sjd |" in table
    assert "| suite-bf16 | 0 |" in table and "| tiny | 0.04 | eager | 1 | zipar |" in table
