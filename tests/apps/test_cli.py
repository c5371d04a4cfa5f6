"""The `visar` command line, run as a user runs it."""

import json
import subprocess
import sys

import pytest

from visar.accel.policy.auto import DEFAULT_CANDIDATES
from visar.apps.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "visar.apps.cli", *args], capture_output=True, text=True)


def test_generate_writes_images_and_stats(tmp_path):
    out = tmp_path / "gen"
    args = "generate --model visar-tiny-random --method ar --class 3 5 --n 3 --batch-size 2 --seed 4 --top-k 20 --out"
    assert main([*args.split(), str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["00000.png", "00001.png", "00002.png"]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["n"] == 3 and stats["method"] == "ar" and stats["model"] == "visar-tiny-random"
    assert stats["forward_passes"] == 2 * 256 and stats["tokens_per_forward"] == 1.0
    assert [r["class_label"] for r in stats["images"]] == [3, 5, 3]
    assert [r["seed"] for r in stats["images"]] == [4, 5, 6]
    assert stats["sampling"]["top_k"] == 20
    assert "entropy_temperature" not in stats["sampling"]  # recorded only when on: older runs' settings still match


def test_generate_records_the_entropy_temperature(tmp_path):
    out = tmp_path / "gen"
    args = "generate --model visar-tiny-random --method sjd --class 3 --n 1 --entropy-temperature 1.4 --out"
    assert main([*args.split(), str(out)]) == 0
    sampling = json.loads((out / "stats.json").read_text())["sampling"]
    assert sampling["entropy_temperature"] == 1.4 and sampling["temperature"] == 1.0


USER_ERRORS = [
    (["generate", "--model", "nope"], "unknown model"),
    (["generate", "--class", "400"], "out of range"),
    (["generate", "--method", "nope"], "unknown method"),
    (["generate", "--top-p", "2"], "top_p"),
    (["generate", "--temperature", "0"], "temperature"),
    (["generate", "--entropy-temperature", "0"], "entropy_temperature"),
    (["generate", "--entropy-temperature", "1.4", "--temperature", "0.7"], "two temperatures"),
    (["generate", "--top-k", "-3"], "top_k"),
    (["generate", "--cfg", "-1"], "guidance_scale"),
    (["generate", "--opt", "window=3"], "unknown option"),
    (["generate", "--model", "llamagen-gpt-b-c2i-256", "--checkpoint", "/no/such.pt"], "not found"),
]


@pytest.mark.parametrize("args,message", USER_ERRORS)
def test_user_errors_exit_2_with_one_line(tmp_path, capsys, args, message):
    """In-process, for the quick tier: the error is one `visar: error:` line (any progress bar comes before it)."""
    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line.startswith("visar: error: ") and message in last_line


@pytest.mark.slow  # a fresh interpreter per case (about 2 s each); the in-process test above checks the same lines
@pytest.mark.parametrize("args,message", USER_ERRORS)
def test_user_errors_exit_2_without_traceback(tmp_path, args, message):
    result = run_cli(*args, "--out", str(tmp_path / "o"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("n", ["0", "-3"])
def test_generate_refuses_fewer_than_one_image(tmp_path, capsys, n):
    out = tmp_path / "o"
    assert main(["generate", "--model", "visar-tiny-random", "--n", n, "--out", str(out)]) == 2
    assert capsys.readouterr().err == "visar: error: --n must be >= 1\n"
    assert not out.exists()


def test_generate_defaults_to_auto_and_records_what_it_ran(tmp_path):
    out = tmp_path / "auto"
    assert main(["generate", "--model", "visar-tiny-random", "--n", "2", "--quiet", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "images.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"auto"}
    assert {r["auto"] for r in records} <= set(DEFAULT_CANDIDATES.split(",")) and len(records) == 2


def test_listing_commands(capsys):
    assert main(["models"]) == 0
    assert "visar-tiny-random" in capsys.readouterr().out
    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    assert "sjd          lossless:" in listing and "gsd          lossy (exact when group_size=1):" in listing
    assert "[raster models; a running batch refills its slots; options: window, warmup, tail, init, budget]" in listing
    assert main(["methods", "--model", "visar-tiny-maskgit-c2i"]) == 0  # only the methods that decode it
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names[0] == "maskgit" and "halton" in names and "ar" not in names and "sjd" not in names


@pytest.mark.slow  # a fresh interpreter
def test_help_documents_every_generate_option():
    result = run_cli("generate", "--help")
    assert result.returncode == 0
    for option in (
        "--model",
        "--method",
        "--seed",
        "--cfg",
        "--temperature",
        "--top-k",
        "--top-p",
        "--entropy-temperature",
        "--opt",
        "--class",
        "--prompt",
        "--n",
        "--batch-size",
        "--deterministic",
        "--out",
        "--device",
        "--dtype",
    ):
        assert option in result.stdout
