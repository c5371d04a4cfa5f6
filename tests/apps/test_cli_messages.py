"""What `visar generate` and `visar demo` say to a user (issue 58): refusals before any work, messages
that name what the user gave, and a last line that says what `auto` ran and what its choice rests on."""

import sys

import pytest

from visar.apps.cli import main
from visar.apps.demo import page as demo_page

GENERATE = ["generate", "--model", "default", "--class", "1", "--quiet"]


def test_a_kv_keep_out_of_range_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["generate", "--model", "default", "--class", "1", "--kv-keep", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "kv_keep must be a number in (0, 1]" in err and "img/s" not in err  # no progress bar was drawn
    assert not out.exists()


def test_an_out_that_is_a_file_says_nothing_was_kept(tmp_path, last_error):
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    assert main([*GENERATE, "--out", str(taken)]) == 2
    error = last_error()
    assert "No image was written" in error and "kept" not in error and "choose another --out" in error
    assert taken.read_text() == "mine"


def test_a_method_of_another_kind_names_the_model_given(tmp_path, last_error):
    assert main([*GENERATE, "--method", "code", "--out", str(tmp_path / "x")]) == 2
    error = last_error()
    assert "method 'code' decodes next-scale models; visar-tiny-c2i is a raster model" in error
    assert "LlamaGen" not in error


def test_the_last_line_says_what_auto_ran_and_what_its_choice_rests_on(tmp_path, capsys, monkeypatch):
    from visar.accel.policy import auto

    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))
    auto.forget_tunings()  # this process has timed nothing yet
    # The AR probe is pinned: on a loaded machine two probes can differ by more than auto.DRIFT, and then
    # the second call times again (that rule has its own test in tests/accel/policy/test_auto.py); this
    # test is about the line.
    monkeypatch.setattr(auto, "ar_step_seconds", lambda request: 1e-3)
    four = [*GENERATE, "--n", "4", "--batch-size", "1"]
    assert main([*four, "--out", str(tmp_path / "one")]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert "; auto ran " in first and "tuned on " in first and "throwaway images before the run" in first
    spec = first.split("; auto ran ")[1].split(":")[0]
    auto.forget_tunings()  # as a second process: the winner comes from the file
    assert main([*four, "--out", str(tmp_path / "two")]) == 0
    second = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"; auto ran {spec}" in second and "throwaway" not in second
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


# -- issue 65: optional dependencies, refused runs, the CLI's own words, the methods of the model ----------------


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("visar: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_eval_shapes_without_scipy_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "scipy", None)  # as if not installed: `import scipy` fails
    monkeypatch.delitem(sys.modules, "visar.eval.detector", raising=False)  # imported afresh, without scipy
    assert main(["eval", "shapes", "--n", "8"]) == 2
    assert one_error_line(capsys) == (
        "visar: error: 'scipy' is not installed: install the eval extra with `pip install -e \".[eval]\"`"
    )


def test_an_optional_import_without_require_names_the_extra_too(monkeypatch, capsys, tmp_path):
    """scikit-image, imported by the shapes world's backgrounds (no `require` there): the CLI says the same."""
    from visar.data import shapes

    monkeypatch.setitem(sys.modules, "skimage", None)
    shapes._background_photos.cache_clear()  # loaded afresh, without scikit-image
    try:
        assert main(["eval", "renders", "--n", "4", "--out", str(tmp_path / "renders")]) == 2
    finally:
        shapes._background_photos.cache_clear()  # the next test loads them with scikit-image again
    assert one_error_line(capsys).endswith('install the data extra with `pip install -e ".[data]"`')


def test_a_missing_module_that_is_no_extra_keeps_its_traceback(monkeypatch):
    from visar.apps.commands import models

    def broken(args):
        import visar_no_such_module  # noqa: F401

    monkeypatch.setattr(models, "run", broken)
    with pytest.raises(ModuleNotFoundError):  # a bug or a broken install: not said as an extra to install
        main(["models"])


REFUSED = {
    "unknown method": ["--method", "nosuch"],
    "masked method on a raster model": ["--method", "maskgit"],
    "bad option value": ["--method", "mc-sjd", "--opt", "window=abc"],
    "unknown option": ["--method", "mc-sjd", "--opt", "nosuch=1"],
}


@pytest.mark.parametrize("refusal", REFUSED)
def test_a_refused_generate_leaves_no_folder(tmp_path, capsys, refusal):
    out = tmp_path / "new" / "run"  # its parent is made by the run too
    assert main([*GENERATE, *REFUSED[refusal], "--out", str(out)]) == 2
    one_error_line(capsys)
    assert not (tmp_path / "new").exists()


def test_a_refused_generate_leaves_a_folder_that_was_there_as_it_was(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main([*GENERATE, "--method", "mc-sjd", "--opt", "window=abc", "--out", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


T2I = ["generate", "--model", "visar-tiny-t2i", "--quiet"]


def test_an_empty_negative_prompt_is_refused_in_the_cli_s_words(tmp_path, capsys):
    assert main([*T2I, "--prompt", "a red circle", "--negative-prompt", "", "--out", str(tmp_path / "o")]) == 2
    error = one_error_line(capsys)
    assert "leave out --negative-prompt" in error and "negative_prompt=None" not in error
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "a red circle", "negative_prompt": ""}\n')
    assert main([*T2I, "--prompts-file", str(lines), "--out", str(tmp_path / "o")]) == 2
    error = one_error_line(capsys)
    assert 'leave out the line\'s "negative_prompt"' in error and "negative_prompt=None" not in error
    assert not (tmp_path / "o").exists()


def test_the_python_api_keeps_its_own_words_for_an_empty_negative_prompt():
    import visar
    from visar.errors import VisarError

    pipe = visar.load("visar-tiny-t2i", device="cpu")
    with pytest.raises(VisarError, match="leave negative_prompt=None"):
        pipe.generate(prompts=["a red circle"], negative_prompt="", output_type="tokens")


def test_an_offline_hub_name_not_cached_says_the_cli_s_way_to_load_a_folder(tmp_path, monkeypatch, capsys):
    import visar
    from visar.errors import VisarError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # empty
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    janus = "deepseek-community/Janus-Pro-1B"
    assert main(["generate", "--model", janus, "--prompt", "a fox", "--out", str(tmp_path / "o")]) == 2
    error = one_error_line(capsys)
    assert "HF_HUB_OFFLINE is set" in error and "--model FOLDER" in error and "visar.load" not in error
    with pytest.raises(VisarError, match=r"its folder by path: visar\.load\(FOLDER\)"):  # the API's own words
        visar.load(janus, device="cpu")


def test_an_unknown_method_lists_the_methods_of_the_model_only(tmp_path, capsys):
    import visar
    from visar.accel import methods_for

    model = "visar-tiny-maskgit-c2i"
    assert main(["generate", "--model", model, "--method", "nosuch", "--out", str(tmp_path / "o")]) == 2
    error = one_error_line(capsys)
    fitting = methods_for(visar.load(model, device="cpu").model)
    assert f"the methods that decode {model} (a masked model): {', '.join(fitting)} " in error
    assert "sjd" not in error and "halton" in error


def test_a_model_loaded_without_its_tokenizer_is_refused_before_generating(tmp_path, capsys):
    """--checkpoint without --vq-checkpoint: tokens that could not become images; said at once, in the CLI's words."""
    import json

    import torch

    from visar.families import get_family
    from visar.families.llamagen import TINY_MODEL_ARGS

    checkpoint = tmp_path / "tiny.pt"
    torch.save(get_family("llamagen").build_model(TINY_MODEL_ARGS).state_dict(), checkpoint)
    model_args = [f"--model-arg={key}={json.dumps(value)}" for key, value in TINY_MODEL_ARGS.items()]
    out = tmp_path / "o"
    command = ["generate", "--model", "llamagen", "--checkpoint", str(checkpoint), *model_args, "--class", "1"]
    assert main([*command, "--method", "ar", "--quiet", "--out", str(out)]) == 2
    error = one_error_line(capsys)
    assert "--vq-checkpoint" in error and "vq_checkpoint=" not in error
    assert not out.exists()
