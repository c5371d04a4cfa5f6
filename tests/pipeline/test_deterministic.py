"""deterministic=True (`visar generate --deterministic`): an image's tokens are the same bits whatever batch,
refill, resume or process count it is decoded in, at any torch thread count (issue 54).

Without it the law is exact and the bits hold only on a CPU at one thread: a multi-threaded BLAS or
a GPU rounds by the batch's shape. These tests make that happen on any machine: every linear layer is
scaled by a factor of its row count (`shape_dependent`), as such a BLAS rounds, only larger, so that
the tokens move. Under it a batch's images differ from their decodes alone (the negative control),
and with deterministic=True they do not.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import file_bytes

import visar
from visar.apps.cli import main
from visar.errors import VisarError

CLASSES = [3, 17, 3, 25]


def shape_dependent(linear, noise: float):
    """F.linear whose result is scaled by 1 + noise x (a factor of its row count)."""

    def by_shape(input, weight, bias=None):
        out = linear(input, weight, bias)
        rows = out.numel() // max(out.shape[-1], 1)
        return out * (1 + noise * (1 + rows % 5) / 5)

    return by_shape


@pytest.fixture
def rows_round(monkeypatch):
    """Linear layers that round by their batch's shape, at any thread count (as a GPU's kernels do)."""
    monkeypatch.setattr(F, "linear", shape_dependent(F.linear, 3e-2))


@pytest.fixture(scope="module")
def pipe():
    return visar.load("default")


def row_counts(pipe, monkeypatch) -> list[int]:
    """The batch (first dimension) of every model call, recorded as they are made."""
    counts, forward = [], pipe.model.forward

    def counted(*args, **kwargs):
        out = forward(*args, **kwargs)
        counts.append(out.shape[0])
        return out

    monkeypatch.setattr(pipe.model, "forward", counted)
    return counts


@pytest.mark.slow  # 10 whole decodes of the embedded default each (7 s for mc-sjd, 11 s for ar)
@pytest.mark.parametrize("method", ["mc-sjd", "ar"])
def test_each_image_is_its_decode_alone_whatever_the_batch(pipe, rows_round, method):
    run = dict(class_labels=CLASSES, method=method, seed=4, output_type="tokens", guidance_scale=2.0)
    alone = [pipe.generate(**{**run, "class_labels": [c], "seed": 4 + i}).tokens[0] for i, c in enumerate(CLASSES)]
    fixed = [pipe.generate(**run, deterministic=True, batch_size=size).tokens for size in (None, 3)]
    for tokens in fixed:
        assert all(torch.equal(tokens[i], alone[i]) for i in range(len(CLASSES)))
    # the negative control: the same batches decoded together move away from the images alone
    together = pipe.generate(**run).tokens
    assert any(not torch.equal(together[i], alone[i]) for i in range(len(CLASSES)))


def test_every_model_call_is_one_images(pipe, monkeypatch):
    run = dict(class_labels=CLASSES[:3], method="mc-sjd", output_type="tokens", guidance_scale=2.0)
    counts = row_counts(pipe, monkeypatch)
    seen = []
    out = pipe.generate(**run, deterministic=True, batch_size=3, on_image=lambda i, tokens, info: seen.append(i))
    assert counts and set(counts) == {2}  # one image's conditional and unconditional rows
    assert seen == [0, 1, 2] and out.stats["deterministic"] and len(out.stats["forward_passes_per_image"]) == 3
    counts.clear()
    pipe.generate(**run, batch_size=3)
    assert max(counts) == 6  # the negative control: a running batch calls the model on all its slots


def test_on_image_gets_each_image_as_it_is_done(pipe):
    got = {}
    out = pipe.generate(
        class_labels=CLASSES, method="sjd", seed=1, output_type="tokens", deterministic=True,
        on_image=lambda i, tokens, info: got.setdefault(i, (tokens, info)),
    )  # fmt: skip
    assert sorted(got) == list(range(len(CLASSES)))
    for i, (tokens, info) in got.items():
        assert torch.equal(tokens, out.tokens[i])
        assert info["forward_passes"] == out.stats["forward_passes_per_image"][i]
        assert torch.equal(info["commit_pass"], out.stats["commit_pass"][i])


def test_a_value_other_than_true_or_false_is_one_sentence(pipe):
    with pytest.raises(VisarError, match="deterministic must be True or False, got 'yes'"):
        pipe.generate(class_labels=[0], deterministic="yes")


@pytest.mark.slow  # three runs of the batch tool (4 s)
def test_the_batch_tool_writes_the_same_files_at_any_batch_size_and_on_resume(rows_round, tmp_path, capsys):
    """--deterministic: batch size 5 and a run resumed at batch size 2 write the same bytes, on a
    machine that rounds by the batch's shape; settings.json records it, so a resume repeats it."""
    args = ["generate", "--model", "default", "--quiet", "--class", "3", "17", "25", "-n", "5", "--seed", "2"]
    args += ["--method", "mc-sjd", "--deterministic"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*args, "--batch-size", "5", "--out", str(one)]) == 0
    assert json.loads((one / "settings.json").read_text())["deterministic"] is True
    assert main([*args, "--batch-size", "1", "-n", "2", "--out", str(two)]) == 0  # 2 of the 5
    capsys.readouterr()
    assert main([*args, "--batch-size", "2", "--out", str(two)]) == 0
    assert "resuming" in capsys.readouterr().err  # (images.jsonl is written once all five are)
    assert file_bytes(one, leave_out={"stats.json"}) == file_bytes(two, leave_out={"stats.json"})
    # without the flag the same folder is refused: its settings say the images were decoded alone
    assert main([*args[:-1], "--out", str(two), "-n", "6"]) == 2


def test_a_resume_says_in_one_line_what_its_images_are(tmp_path, capsys):
    args = ["generate", "--model", "visar-tiny-random", "--class", "1", "-n", "3", "--method", "ar", "--quiet"]
    out = tmp_path / "run"
    assert main([*args, "-n", "1", "--out", str(out)]) == 0  # one of the three
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("resuming")]
    assert lines == [
        f"resuming {out}: 1 of 3 images kept; the other 2 are new draws of the same law: bit-identical to an "
        "uninterrupted run only on a CPU at one torch thread (--deterministic: on any device and batch size)"
    ]
