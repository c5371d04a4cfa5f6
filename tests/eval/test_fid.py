"""`visar eval fid`: index-derived sample sets (shards, resume), the ADM .npz pack, torch-fidelity metrics."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import file_bytes
from PIL import Image

import visar
from visar.apps.cli import main
from visar.errors import VisarError
from visar.eval import samples as samples_module
from visar.eval.fid import (
    INCEPTION_FILE,
    SHAPES,
    ImageFilesDataset,
    compute_metrics,
    evaluate_fid,
    fid_jobs,
    npz_shape,
    sample_path,
    write_renders,
)
from visar.eval.samples import one_cpu_thread

pytest.importorskip("torch_fidelity")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A seeded random class-conditional model with 4 classes and 16x16 px images (4x4 tokens): fast."""
    folder = tmp_path_factory.mktemp("tiny4")
    config = {
        "name": "tiny4",
        "model_args": {
            "dim": 32,
            "n_layer": 1,
            "n_head": 2,
            "vocab_size": 64,
            "num_classes": 4,
            "block_size": 16,
            "cls_token_num": 1,
            "model_type": "c2i",
        },
        "vq_args": {
            "codebook_size": 64,
            "codebook_embed_dim": 4,
            "encoder_ch_mult": [1, 2, 2],
            "decoder_ch_mult": [1, 2, 2],
            "z_channels": 32,
            "ch": 32,
            "num_res_blocks": 1,
        },
        "init": {"random_seed": 0},
        "defaults": {"guidance_scale": 1.0},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def pipe(tiny_folder):
    return visar.load(str(tiny_folder), device="cpu")


@pytest.fixture(scope="module")
def renders(tmp_path_factory):
    """Two disjoint sets of 16 ground-truth class renders (seeds 0.. and 1000..)."""
    a, b = tmp_path_factory.mktemp("renders_a"), tmp_path_factory.mktemp("renders_b")
    write_renders(a, 16, seed=0, progress=False)
    write_renders(b, 16, seed=1000, progress=False)
    return a, b


@pytest.fixture(autouse=True)
def _torch_home(tmp_path, monkeypatch):
    # torch-fidelity caches features of registered inputs under $TORCH_HOME; Inception weights are looked up there
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))


def test_labels_and_seeds_come_from_the_index(pipe, tmp_path):
    jobs = fid_jobs(pipe, tmp_path, 8, seed=5)
    assert [j.condition for j in jobs] == [0, 1, 2, 3, 0, 1, 2, 3]  # an equal number per class
    assert [j.seed for j in jobs] == list(range(5, 13))
    assert [j.path for j in jobs] == [sample_path(tmp_path, g) for g in range(8)]
    shard = fid_jobs(pipe, tmp_path, 8, seed=5, shard=(1, 3))
    assert [(j.condition, j.seed) for j in shard] == [(1, 6), (0, 9), (3, 12)]  # g = 1, 4, 7


@pytest.mark.one_thread  # shards' files, byte for byte
def test_shards_give_the_same_files_as_one_run(pipe, tmp_path):
    one, split = tmp_path / "one", tmp_path / "split"
    evaluate_fid(one, pipe=pipe, n=8, seed=3, batch_size=8, progress=False)
    for index in range(3):  # shards of 3, 3 and 2 images, batches of 2: other batch compositions
        record = evaluate_fid(split, pipe=pipe, n=8, seed=3, shard=(index, 3), batch_size=2, progress=False)
        assert "npz" not in record and record["generated"] == len(range(index, 8, 3))
    pngs = file_bytes(one / "samples", pattern="*.png")  # the sample images, by name
    assert file_bytes(split / "samples", pattern="*.png") == pngs and len(pngs) == 8
    # the last, unsharded run finds every image and only packs them
    record = evaluate_fid(split, pipe=pipe, n=8, seed=3, progress=False)
    assert record["generated"] == 0 and record["reused"] == 8
    with np.load(split / "samples.npz") as data:
        assert data.files == ["arr_0"]
        pack = data["arr_0"]
    assert pack.dtype == np.uint8 and pack.shape == (8, 16, 16, 3) == npz_shape(split / "samples.npz")
    for g in range(8):
        np.testing.assert_array_equal(pack[g], np.asarray(Image.open(sample_path(split, g))))
    # a sample's pixels are those of one image generated alone with seed SEED + g and class g mod 4
    with one_cpu_thread():  # sample sets are decoded on one CPU thread (visar.eval.samples)
        out = pipe.generate(class_labels=[2], generator=torch.Generator().manual_seed(3 + 6), output_type="np")
    np.testing.assert_array_equal(pack[6], out.images[0])


@pytest.mark.one_thread  # a resumed run's files, byte for byte
def test_interrupted_run_resumes_without_regenerating(pipe, tmp_path, monkeypatch):
    out = tmp_path / "run"
    evaluate_fid(out, pipe=pipe, n=8, shard=(0, 2), progress=False)  # the "interrupted" run: half the images
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (out / "samples").glob("*.png")}
    truncated = sample_path(out, 2)
    full = truncated.read_bytes()
    truncated.write_bytes(full[: len(full) // 2])  # killed mid-write by a non-atomic writer
    (out / "samples" / ".000004.png.123.tmp").write_bytes(b"partial")  # a leftover temporary file

    calls = []
    real_generate = visar.pipeline.Pipeline.generate

    def counting_generate(self, *args, **kwargs):
        calls.append(len(kwargs["generator"]))
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(visar.pipeline.Pipeline, "generate", counting_generate)
    record = evaluate_fid(out, pipe=pipe, n=8, batch_size=16, progress=False)
    assert record["generated"] == 5 and record["reused"] == 3 and sum(calls) == 5  # odd g and the truncated g = 2
    assert truncated.read_bytes() == full  # regenerated identically
    for path, (mtime, data) in before.items():
        if path != truncated:
            assert path.stat().st_mtime_ns == mtime and path.read_bytes() == data
    calls.clear()
    record = evaluate_fid(out, pipe=pipe, n=8, progress=False)
    assert record["generated"] == 0 and calls == []
    assert sorted(p.name for p in (out / "samples").glob("*.png")) == [f"{g:06d}.png" for g in range(8)]


def test_a_resumed_run_must_keep_its_settings(pipe, tmp_path):
    evaluate_fid(tmp_path, pipe=pipe, n=4, seed=0, shard=(0, 4), progress=False)
    with pytest.raises(VisarError, match="holds images of another run .*seed"):
        evaluate_fid(tmp_path, pipe=pipe, n=4, seed=1, shard=(0, 4), progress=False)
    with pytest.raises(VisarError, match="holds images of another run .*method"):
        evaluate_fid(tmp_path, pipe=pipe, n=4, method="sjd", shard=(0, 4), progress=False)


def test_bad_sample_counts(pipe, tmp_path):
    with pytest.raises(VisarError, match="smaller than the 4 classes"):
        fid_jobs(pipe, tmp_path, 3)
    with pytest.raises(VisarError, match="not a multiple of the 4 classes .*4 or 8"):
        fid_jobs(pipe, tmp_path, 6)
    assert main(["eval", "fid", "--model", "visar-tiny-random", "--n", "10", "--out", str(tmp_path)]) == 2
    assert main(["eval", "fid", "--n", "40", "--out", str(tmp_path), "--shard", "2/2"]) == 2


def test_bad_references(renders, tmp_path):
    a, _ = renders
    samples = ImageFilesDataset(sorted(a.glob("*.png")))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    with pytest.raises(VisarError, match="reference folder .*empty holds no images"):
        compute_metrics(samples, str(empty), feature_extractor=SHAPES)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    Image.new("RGB", (64, 64)).save(mixed / "a.png")
    Image.new("RGB", (32, 32)).save(mixed / "b.png")
    with pytest.raises(VisarError, match="mixes image sizes: a.png is 64x64, b.png is 32x32"):
        compute_metrics(samples, str(mixed), feature_extractor=SHAPES)
    with pytest.raises(VisarError, match="neither a folder, an .npz file, nor a torch-fidelity registered input"):
        compute_metrics(samples, str(tmp_path / "nowhere"), feature_extractor=SHAPES)
    np.savez(tmp_path / "bad.npz", mu=np.zeros(5), sigma=np.eye(5))
    with pytest.raises(VisarError, match="5 dimensions, visar-shapes-vq gives 128"):
        compute_metrics(samples, str(tmp_path / "bad.npz"), feature_extractor=SHAPES)


def test_missing_inception_weights_say_which_file_goes_where(renders, tmp_path):
    a, _ = renders
    samples = ImageFilesDataset(sorted(a.glob("*.png")))
    expected = os.path.join(str(tmp_path / "torch_home"), "hub", "checkpoints", INCEPTION_FILE)
    with pytest.raises(VisarError, match="Inception weights not found") as err:
        compute_metrics(samples, str(a))
    assert INCEPTION_FILE in str(err.value) and expected in str(err.value) and "--inception-weights" in str(err.value)
    with pytest.raises(VisarError, match="no such file"):
        compute_metrics(samples, str(a), weights=str(tmp_path / "missing.pth"))


def test_shapes_extractor_distances(renders):
    a, b = renders
    set_a = ImageFilesDataset(sorted(a.glob("*.png")))
    same = compute_metrics(set_a, str(a), feature_extractor=SHAPES)
    other = compute_metrics(set_a, str(b), feature_extractor=SHAPES)
    fd = "frechet_distance_visar_shapes_vq"
    assert "frechet_inception_distance" not in same["metrics"] and "inception_score_mean" not in same["metrics"]
    assert abs(same["metrics"][fd]) < 1e-3 and other["metrics"][fd] > 100 * max(abs(same["metrics"][fd]), 1e-3)
    assert same["metrics"]["precision_visar_shapes_vq"] == same["metrics"]["recall_visar_shapes_vq"] == 1.0
    # 16 renders of classes 0..15, each detected as its class; the IS formula in 10 splits of 1 or 2 images
    # (sizes 1,2,1,2,2,1,2,1,2,2) gives exp(entropy of each split's classes): (4 x 1 + 6 x 2) / 10
    assert same["metrics"]["detector_class_score_mean"] == pytest.approx(1.6, abs=1e-3)
    assert any("NOT Inception" in note for note in same["notes"])


def test_statistics_registered_and_npz_references_agree(renders, tmp_path):
    import torch_fidelity
    from torch_fidelity.registry import DATASETS_REGISTRY

    from visar.eval.fid import ArrayDataset
    from visar.eval.shapes_features import ShapesFeatureExtractor

    a, b = renders
    set_a = ImageFilesDataset(sorted(a.glob("*.png")))
    ref_images = np.stack([np.asarray(Image.open(p)) for p in sorted(b.glob("*.png"))])  # [16, 64, 64, 3]
    folder = compute_metrics(set_a, str(b), feature_extractor=SHAPES, isc=False)["metrics"]
    # mu/sigma of the reference, as an ADM-style statistics file (plus its images for precision/recall)
    extractor = ShapesFeatureExtractor(SHAPES, ["vq_latent"])
    (features,) = extractor(torch.from_numpy(ref_images).permute(0, 3, 1, 2))
    features = features.double().numpy()
    np.savez(tmp_path / "stats.npz", mu=features.mean(0), sigma=np.cov(features, rowvar=False), arr_0=ref_images)
    stats = compute_metrics(set_a, str(tmp_path / "stats.npz"), feature_extractor=SHAPES, isc=False)["metrics"]
    np.savez(tmp_path / "images.npz", arr_0=ref_images)
    packed = compute_metrics(set_a, str(tmp_path / "images.npz"), feature_extractor=SHAPES, isc=False)["metrics"]
    if "visar-test-renders" not in DATASETS_REGISTRY:
        torch_fidelity.register_dataset("visar-test-renders", lambda root, download: ArrayDataset(ref_images))
    registered = compute_metrics(set_a, "visar-test-renders", feature_extractor=SHAPES, isc=False)["metrics"]
    for other in (stats, packed, registered):
        assert set(other) == set(folder)
        for key in folder:
            assert other[key] == pytest.approx(folder[key], rel=1e-4, abs=1e-6), key
    # statistics alone (as MAR's adm_in256_stats.npz): FID, and a note instead of precision/recall
    np.savez(tmp_path / "mu_sigma.npz", mu=features.mean(0), sigma=np.cov(features, rowvar=False))
    only = compute_metrics(set_a, str(tmp_path / "mu_sigma.npz"), feature_extractor=SHAPES, isc=False)
    assert set(only["metrics"]) == {"frechet_distance_visar_shapes_vq"} and "statistics only" in only["notes"][-1]
    fd = "frechet_distance_visar_shapes_vq"
    assert only["metrics"][fd] == pytest.approx(folder[fd], rel=1e-4)


def test_cli_fid_end_to_end_and_images_npz(tiny_folder, renders, tmp_path, capsys):
    a, _ = renders
    out = tmp_path / "fid"
    args = ["eval", "fid", "--model", str(tiny_folder), "--n", "8", "--out", str(out), "--ref", str(a)]
    args += ["--feature-extractor", SHAPES, "--device", "cpu", "--dtype", "fp32", "--no-compile", "--batch-size", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "NOT Inception FID" in printed and "8 images generated" in printed
    record = json.loads((out / "metrics.json").read_text())
    assert record["feature_extractor"] == SHAPES and record["n"] == 8 and record["reference"]["kind"] == "folder"
    assert record["metrics"]["frechet_distance_visar_shapes_vq"] > 1  # random-weight noise against renders
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "tiny4" and config["seed"] == 0 and config["conditions"] == "class g mod 4"
    # the written pack scores exactly as the folder it was made from
    kwargs = {"feature_extractor": SHAPES}
    again = evaluate_fid(tmp_path / "again", images=str(out / "samples.npz"), ref=str(a), metric_kwargs=kwargs)
    assert again["metrics"] == pytest.approx(record["metrics"], rel=1e-6)
    assert main(args) == 0 and "0 images generated, 8 already there" in capsys.readouterr().out


def test_renders_are_resumable_and_seeded(tmp_path):
    from visar.data.shapes import render_class

    assert write_renders(tmp_path, 3, seed=7, progress=False) == 3
    assert write_renders(tmp_path, 5, seed=7, progress=False) == 2  # extends, keeps the first three
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "000004.png")), render_class(4, 11).image)
    assert samples_module.is_complete_png(tmp_path / "000000.png")


def test_renders_follow_the_models_training_world(tiny_folder, tmp_path):
    from visar.data.shapes import render_class
    from visar.eval.fid import render_options_of

    config = json.loads((tiny_folder / "config.json").read_text())
    easy = tmp_path / "easy_model"
    easy.mkdir()
    config["recipe"] = {"render": {"min_size": 20, "background_amplitude": [6.0, 14.0]}}
    (easy / "config.json").write_text(json.dumps(config))
    assert render_options_of(str(easy)) == {"min_size": 20, "background_amplitude": (6.0, 14.0)}
    assert render_options_of(str(tiny_folder)) == {}
    assert main(["eval", "renders", "--n", "2", "--out", str(tmp_path / "r"), "--model", str(easy)]) == 0
    expected = render_class(1, 1, min_size=20, background_amplitude=(6.0, 14.0)).image
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "r" / "000001.png")), expected)
    assert main(["eval", "renders", "--n", "2", "--out", str(tmp_path / "r"), "--model", str(tmp_path)]) == 2
