"""`visar models`: every family visar loads, with the Hub names and the extra its registration declares, and
what the names are; `visar models | head` ends quietly (issue 65)."""

import subprocess
import sys

from visar.apps.cli import main
from visar.apps.commands.models import ANY_FOLDER
from visar.errors import install_command
from visar.families import FAMILIES


def families_section(capsys, *args) -> list[str]:
    assert main(["models", *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Families:\n") and ANY_FOLDER in out
    return out.split(ANY_FOLDER)[0].splitlines()[1:]


def test_models_names_every_family_visar_loads(capsys):
    lines = families_section(capsys)
    titles = ["LlamaGen", "VAR", "MAR", "Janus-Pro", "Emu3", "Lumina-mGPT 1.0 and 2.0", "aMUSEd"]
    for title in titles:
        assert [line for line in lines if line.strip().startswith(title)], f"{title} missing from {lines}"


def test_each_family_line_carries_its_registration(capsys):
    """The Hub names and the extra come from the registrations: a name added to a family shows without an edit here."""
    lines = families_section(capsys)
    listed = [family for family in FAMILIES.values() if family.title]
    assert len(lines) == len(listed)
    for family in listed:
        (line,) = [line for line in lines if line.strip().startswith(family.title)]
        assert all(name in line for name in family.hub_names), line
        assert (install_command(family.extra) in line) == (family.extra is not None), line
    janus = next(line for line in lines if "Janus-Pro" in line)  # the original names that fetch the conversions
    assert "deepseek-ai/Janus-Pro-1B" in janus and 'pip install -e ".[hf]"' in janus


def test_a_family_left_out_of_the_listing_loads_nothing_by_itself():
    """A registration without a title (Lumina-mGPT 2.0's second one, for the tests) must not be a way in that
    `visar models` hides: no folder format, preset or generic name of its own."""
    for family in FAMILIES.values():
        if family.title is None:
            assert family.load_folder is None and not family.official_presets and family.generic_name is None
            assert not family.architectures and not family.pipeline_classes


def test_models_verbose_shows_defaults_and_folder_formats(capsys):
    assert main(["models", "-v"]) == 0
    out = capsys.readouterr().out
    assert "reads folders whose config.json names JanusForConditionalGeneration (transformers)" in out
    assert "reads diffusers pipeline folders of AmusedPipeline" in out
    names = out.split("Names (--model NAME):")[1].splitlines()
    preset = names.index(next(line for line in names if line.strip().startswith("var-d16 ")))
    assert names[preset + 1].strip().startswith("defaults: {'guidance_scale': 2.5")  # a preset's too, not only embedded


def test_a_reader_that_stops_early_ends_the_listing_quietly():
    """`visar models -v | head -5`: the reader closes the pipe; no `visar: error: Broken pipe`, no traceback."""
    listing = subprocess.Popen(
        [sys.executable, "-m", "visar", "models", "-v"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    listing.stdout.close()  # before the first line is written: every write meets a closed pipe
    stderr = listing.stderr.read()
    assert listing.wait(timeout=120) == 141 and stderr == ""
