"""What `visar generate` and `visar demo` say to a user (issue 58): refusals before any work, messages
that name what the user gave, and a last line that says what `auto` ran and what its choice rests on."""

import pytest

from visar.apps.cli import main
from visar.apps.demo import page as demo_page

GENERATE = ["generate", "--model", "default", "--class", "1", "--quiet"]


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_kv_keep_out_of_range_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["generate", "--model", "default", "--class", "1", "--kv-keep", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "kv_keep must be a number in (0, 1]" in err and "img/s" not in err  # no progress bar was drawn
    assert not out.exists()


def test_an_out_that_is_a_file_says_nothing_was_kept(tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    assert main([*GENERATE, "--out", str(taken)]) == 2
    error = last_error(capsys)
    assert "No image was written" in error and "kept" not in error and "choose another --out" in error
    assert taken.read_text() == "mine"


def test_a_method_of_another_kind_names_the_model_given(tmp_path, capsys):
    assert main([*GENERATE, "--method", "code", "--out", str(tmp_path / "x")]) == 2
    error = last_error(capsys)
    assert "method 'code' decodes next-scale models; visar-tiny-c2i is a raster model" in error
    assert "LlamaGen" not in error


def test_the_last_line_says_what_auto_ran_and_what_its_choice_rests_on(tmp_path, capsys, monkeypatch):
    from visar.accel.policy import auto

    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))
    auto.forget_tunings()  # this process has timed nothing yet
    # The AR probe is pinned: on a loaded machine two probes can differ by more than auto.DRIFT, and then
    # the second call times again (that rule has its own test in test_auto.py); this test is about the line.
    monkeypatch.setattr(auto, "ar_step_seconds", lambda request: 1e-3)
    four = [*GENERATE, "--n", "4", "--batch-size", "1"]
    assert main([*four, "--out", str(tmp_path / "one")]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert "; auto ran mc-sjd: tuning: 1 of 5 candidates timed so far (images/s: mc-sjd " in first
    auto.forget_tunings()  # as a second process: the round timed so far comes from the file
    assert main([*four, "--out", str(tmp_path / "two")]) == 0
    second = capsys.readouterr().out.strip().splitlines()[-1]
    assert "; auto ran mc-sjd:8: tuning: 2 of 5 candidates timed so far" in second and "(kept on disk)" in second
    auto.forget_tunings()


class FakeBlocks:
    """What `launch` needs of the built page, without a server."""

    local_url, share_url = "http://127.0.0.1:7999/", None

    def launch(self, **kwargs):
        self.kwargs = kwargs

    def block_thread(self):
        pass


@pytest.mark.parametrize("share", [False, True])
def test_the_demo_start_line_names_visar_s_flag_not_gradio_s(monkeypatch, capsys, share):
    page = FakeBlocks()
    monkeypatch.setattr(demo_page, "build_demo", lambda **kwargs: page)
    demo_page.launch(host="127.0.0.1", port=7999, share=share)
    printed = capsys.readouterr().out
    assert page.kwargs["quiet"] is True and page.kwargs["share"] is share  # Gradio's own lines say share=True
    assert "visar demo running on http://127.0.0.1:7999/" in printed and "--share" in printed
    assert "share=True" not in printed


def test_import_visar_and_the_help_import_no_torch():
    """`import visar` and `visar --help` answer at once: the API (torch, the models) loads on first use."""
    import subprocess
    import sys

    probe = (
        "import sys, visar; from visar.apps.cli import build_parser; build_parser().format_help(); "
        "print('torch' in sys.modules, visar.__version__); visar.load; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", visar_version(), "True"]  # visar.load brings it in


def visar_version() -> str:
    import visar

    return visar.__version__
