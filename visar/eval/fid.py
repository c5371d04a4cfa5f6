"""`visar eval fid`: an index-derived sample set, its ADM `.npz` pack, and torch-fidelity metrics.

The sample set. Image g (0 <= g < N) is a function of g alone, so the set is the same whatever
the batch size, the number of processes (`--shard I/K` takes the g with g mod K = I) and the
interruptions (a rerun skips complete files, see `visar.eval.samples`):
- class-conditional: class g mod C, so N must be a multiple of the C classes (an equal number
  per class; MAR/VAR's 50 per class for N = 50,000 on ImageNet);
- text-conditional: prompt g mod P of a GenEval-format metadata file;
- seed: SEED + g, the convention of `visar generate` and `visar eval shapes`.
Files: OUT/samples/000000.png ..., OUT/config.json (what decides the pixels; a resumed run must
match it), OUT/samples.npz (`arr_0`, uint8 [N, H, W, 3], the ADM evaluator's sample batch),
OUT/metrics.json.

The metrics, with torch-fidelity (`pip install 'visar-ar[eval]'`), against `--ref`:
- a folder of images or a torch-fidelity registered input (e.g. `cifar10-train`):
  `torch_fidelity.calculate_metrics(input1=<the N samples>, input2=REF, fid, isc, prc)`;
- an `.npz` with `mu` and `sigma` (ADM's `VIRTUAL_imagenet256_labeled.npz`, MAR's
  `adm_in256_stats.npz`): sample features through the same extractor, then torch-fidelity's
  public `fid_features_to_statistics` / `fid_statistics_to_metric` (as MAR's
  `fid_statistics_file`, on stock torch-fidelity); precision/recall when it also holds
  reference images (`arr_0`);
- an `.npz` with only `arr_0`: those images.
Feature extractors: `inception-v3-compat` (torch-fidelity's TF-compatible Inception; FID, IS
and precision/recall all on Inception features, as ADM's suite, where torch-fidelity would
default to VGG16 for precision/recall), with weights from `--inception-weights` or the torch hub
cache; or `visar-shapes-vq` (offline, CPU; `visar.eval.shapes_features`), whose numbers are
renamed so they are never read as Inception's.
"""

from __future__ import annotations

import hashlib
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import VisarError, require
from .samples import (
    SampleJob,
    check_run_config,
    generate_missing,
    is_complete_png,
    recorded_choice,
    settled_method,
    write_atomic,
    write_json_atomic,
    writing,
)

INCEPTION = "inception-v3-compat"
SHAPES = "visar-shapes-vq"
FEATURE_EXTRACTORS = (INCEPTION, SHAPES)
INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_FILE}"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
# torch-fidelity's result keys -> the names visar reports for the shapes extractor.
SHAPES_METRIC_NAMES = {
    "frechet_inception_distance": "frechet_distance_visar_shapes_vq",
    "kernel_inception_distance_mean": "kernel_distance_visar_shapes_vq_mean",
    "kernel_inception_distance_std": "kernel_distance_visar_shapes_vq_std",
    "inception_score_mean": "detector_class_score_mean",
    "inception_score_std": "detector_class_score_std",
    "precision": "precision_visar_shapes_vq",
    "recall": "recall_visar_shapes_vq",
    "f_score": "f_score_visar_shapes_vq",
}


# -- the sample set ----------------------------------------------------------------------------------


def parse_shard(text: str | None) -> tuple[int, int]:
    """`I/K` -> (I, K), 0 <= I < K; None -> (0, 1)."""
    if text is None:
        return 0, 1
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise VisarError(f"--shard takes I/K (e.g. 0/8), got {text!r}") from None
    if not 0 <= index < count:
        raise VisarError(f"--shard I/K needs 0 <= I < K, got {text!r}")
    return index, count


def sample_path(out: Path, index: int) -> Path:
    return Path(out) / "samples" / f"{index:06d}.png"


def fid_conditions(pipe, n: int, prompts: list[str] | None = None) -> list:
    """Condition of image g for g < n: class g mod C (n a multiple of C), or prompt g mod P."""
    if n < 1:
        raise VisarError("--n must be >= 1")
    if pipe.is_class_conditional:
        classes = pipe.num_classes
        if n < classes:
            raise VisarError(
                f"--n {n} is smaller than the {classes} classes of {pipe.name}: give at least one image per class"
            )
        if n % classes:
            raise VisarError(
                f"--n {n} is not a multiple of the {classes} classes of {pipe.name}: give a multiple "
                f"(e.g. {n - n % classes} or {n - n % classes + classes}) so every class has as many images"
            )
        return [g % classes for g in range(n)]
    if not prompts:
        raise VisarError(f"{pipe.name} is text-conditional: it needs prompts (--metadata FILE)")
    return [prompts[g % len(prompts)] for g in range(n)]


def fid_jobs(pipe, out: Path, n: int, *, seed: int = 0, shard: tuple[int, int] = (0, 1), prompts=None):
    """The SampleJobs of this shard: image g with its condition and seed SEED + g."""
    conditions = fid_conditions(pipe, n, prompts)
    index, count = shard
    return [SampleJob(sample_path(out, g), conditions[g], seed + g) for g in range(index, n, count)]


def run_identity(pipe, args_identity: dict, prompts: list[str] | None) -> dict:
    """What decides the pixels of a run's images (compared when a run resumes)."""
    identity = {
        "command": "eval fid",
        "model": pipe.name,
        **args_identity,
        "dtype": str(pipe.dtype).removeprefix("torch."),
    }
    if pipe.is_class_conditional:
        identity["conditions"] = f"class g mod {pipe.num_classes}"
    else:
        digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:12]
        identity["conditions"] = f"prompt g mod {len(prompts)} (sha256 {digest})"
    return identity


# -- reading images ----------------------------------------------------------------------------------


class ImageFilesDataset(Dataset):
    """Image files -> uint8 tensors [3, H, W] (what torch-fidelity's extractors take)."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with Image.open(self.paths[i]) as image:
            return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


class ArrayDataset(Dataset):
    """uint8 [N, H, W, 3] array -> uint8 tensors [3, H, W]."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self):
        return len(self.array)

    def __getitem__(self, i):
        return torch.from_numpy(np.ascontiguousarray(self.array[i])).permute(2, 0, 1)


def folder_images(folder: Path, what: str) -> list[Path]:
    """The image files directly in a folder, sorted; VisarError when there are none or sizes differ."""
    paths = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not paths:
        raise VisarError(f"{what} {folder} holds no images (.png, .jpg, .jpeg)")
    check_same_size(paths, what)
    return paths


def check_same_size(paths: list[Path], what: str) -> tuple[int, int]:
    """(width, height) shared by all the images; VisarError naming two files that differ."""
    size = None
    for path in paths:
        try:
            with Image.open(path) as image:  # reads the header only
                this = image.size
        except OSError as err:
            raise VisarError(f"{what}: cannot read {path}: {err}") from err
        if size is None:
            size, first = this, path
        elif this != size:
            raise VisarError(
                f"{what} mixes image sizes: {first.name} is {size[0]}x{size[1]}, {path.name} is {this[0]}x{this[1]}"
            )
    return size


def read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise VisarError(f"cannot read {path} as an .npz file: {err}") from err


def check_image_array(array: np.ndarray, what: str) -> np.ndarray:
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3 or len(array) == 0:
        raise VisarError(f"{what} arr_0 must be uint8 [N, H, W, 3] with N >= 1, got {array.dtype} {list(array.shape)}")
    return array


# -- the ADM pack ----------------------------------------------------------------------------------


def npz_shape(path: Path) -> tuple | None:
    """Shape of arr_0 in an .npz, read from its header only; None when absent or unreadable."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open("arr_0.npy") as member:
            version = np.lib.format.read_magic(member)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, _, _ = read_header(member)
            return tuple(shape)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None


def write_npz(paths: list[Path], npz: Path, size: tuple[int, int] | None = None) -> tuple:
    """Pack images into `npz` as arr_0, uint8 [N, H, W, 3] (ADM's sample batch), one image in memory at a time.

    size: the images' (width, height) when already checked. Written as np.savez writes (a stored
    zip member `arr_0.npy`), through a temporary file.
    """
    width, height = size or check_same_size(paths, "the sample set")
    shape = (len(paths), height, width, 3)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False, "shape": shape}

    def write(file):
        with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            with archive.open("arr_0.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_2_0(member, header)
                for path in paths:
                    with Image.open(path) as image:
                        member.write(np.asarray(image.convert("RGB"), dtype=np.uint8).tobytes())

    write_atomic(Path(npz), write)
    return shape


# -- ground-truth renders (shapes world) -------------------------------------------------------------


def render_options_of(model: str) -> dict:
    """`render_class` options of a shapes-world model's training data (its config's recipe; {} = the full world)."""
    from ..data.shapes import class_render_options
    from ..registry import embedded_models, read_config, resolve_name

    name = resolve_name(model)
    folder = embedded_models().get(name, Path(name))
    if not (folder / "config.json").is_file():
        raise VisarError(f"--model {model}: not an embedded model nor a model folder with config.json")
    return class_render_options(read_config(folder).get("recipe"))


def write_renders(
    out: str | Path,
    n: int,
    *,
    text: bool = False,
    metadata=None,
    seed: int = 0,
    class_render: dict | None = None,
    progress: bool = True,
) -> int:
    """Ground-truth shapes-world renders laid out as `eval fid` lays out a model's images; returns how many were new.

    Image g: `render_class(g mod 40, SEED + g, **class_render)`, or with `text` the metadata's
    entry g mod P (`render_from_metadata`, default the shipped prompt set). Files
    OUT/000000.png ..., flat, so the folder is a `--ref`; complete files are kept, so a rerun with
    a larger n extends the set.
    """
    from ..data.shapes import NUM_CLASSES, render_class, render_from_metadata
    from ..progress import progress_bar
    from .geneval import check_shapes_world, load_metadata
    from .samples import save_png

    if n < 1:
        raise VisarError("--n must be >= 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if text:
        entries = load_metadata(metadata)
        check_shapes_world(entries, metadata or "the shipped metadata")
    written = 0
    for g in progress_bar(range(n), enabled=progress, desc="renders", unit="img", leave=True):
        path = out / f"{g:06d}.png"
        if is_complete_png(path):
            continue
        if text:
            sample = render_from_metadata(entries[g % len(entries)], seed + g)
        else:
            sample = render_class(g % NUM_CLASSES, seed + g, **(class_render or {}))
        save_png(sample.image, path)
        written += 1
    return written


# -- references and weights --------------------------------------------------------------------------


def inception_weights(path: str | None) -> str:
    """The Inception weights file: --inception-weights, else torch hub's cache; VisarError when neither has it."""
    if path is not None:
        if not Path(path).is_file():
            raise VisarError(f"--inception-weights {path}: no such file")
        return str(path)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_FILE
    if cached.is_file():
        return str(cached)
    raise VisarError(
        f"Inception weights not found: download {INCEPTION_FILE} ({INCEPTION_URL}) and pass it with "
        f"--inception-weights FILE or put it at {cached} (or use --feature-extractor {SHAPES} for shapes-world "
        "models, offline)"
    )


def resolve_reference(ref: str) -> dict:
    """--ref -> {"kind": "folder" | "registered" | "images-npz" | "statistics", "input" | "stats" ..., "name"}."""
    from torch_fidelity.registry import DATASETS_REGISTRY

    path = Path(ref)
    if path.is_dir():
        folder_images(path, "reference folder")  # fails early: empty, mixed sizes
        return {"kind": "folder", "input": str(path), "name": str(path)}
    if ref in DATASETS_REGISTRY:
        return {"kind": "registered", "input": ref, "name": ref}
    if path.is_file() and path.suffix == ".npz":
        data = read_npz(path)
        images = check_image_array(data["arr_0"], f"reference {path}") if "arr_0" in data else None
        if "mu" in data and "sigma" in data:
            stats = {"mu": data["mu"].astype(np.float64), "sigma": data["sigma"].astype(np.float64)}
            return {"kind": "statistics", "stats": stats, "images": images, "name": str(path)}
        if images is not None:
            return {"kind": "images-npz", "input": ArrayDataset(images), "name": str(path)}
        raise VisarError(f"reference {path} has neither mu/sigma statistics nor arr_0 images")
    raise VisarError(
        f"--ref {ref!r} is neither a folder, an .npz file, nor a torch-fidelity registered input "
        f"({', '.join(DATASETS_REGISTRY)})"
    )


# -- metrics ---------------------------------------------------------------------------------------


def compute_metrics(
    samples: Dataset,
    ref: str,
    *,
    feature_extractor: str = INCEPTION,
    weights: str | None = None,
    isc: bool = True,
    prc: bool = True,
    device: torch.device | str = "cpu",
    batch_size: int = 64,
    verbose: bool = False,
) -> dict:
    """FID (+ IS, precision/recall) of `samples` against `ref` with torch-fidelity; see the module docstring.

    Returns {"feature_extractor", "reference", "metrics", "notes"}; for the shapes extractor the
    metric names say so (SHAPES_METRIC_NAMES).
    """
    tf = require("torch_fidelity", "eval")
    if feature_extractor not in FEATURE_EXTRACTORS:
        raise VisarError(
            f"unknown --feature-extractor {feature_extractor!r}; use one of {', '.join(FEATURE_EXTRACTORS)}"
        )
    if len(samples) < 2:
        raise VisarError("FID needs at least 2 images")
    device = torch.device(device)
    weights, notes = extractor_weights(feature_extractor, weights)
    reference = resolve_reference(ref)
    if prc and len(samples) < 5:
        raise VisarError("precision/recall (k = 3 neighbours) needs at least 5 images: raise --n or pass --no-prc")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = dict(
        feature_extractor=feature_extractor,
        feature_extractor_weights_path=weights,
        cuda=device.type == "cuda",
        batch_size=batch_size,
        isc_splits=min(10, len(samples)),
        save_cpu_ram=True,  # no DataLoader worker processes; precision/recall in blocks
        verbose=verbose,
    )
    try:
        if reference["kind"] != "statistics":
            metrics = tf.calculate_metrics(
                input1=samples, input2=reference["input"], fid=True, isc=isc, prc=prc, **kwargs
            )
        else:
            metrics = metrics_against_statistics(samples, ref, reference, isc, prc, notes, kwargs)
    except VisarError:
        raise
    except ValueError as err:  # torch-fidelity's own input checks (vassert)
        raise VisarError(f"torch-fidelity: {err}") from err
    if feature_extractor == SHAPES:
        metrics = {SHAPES_METRIC_NAMES.get(k, k): v for k, v in metrics.items()}
    return {
        "feature_extractor": feature_extractor,
        "reference": {"kind": reference["kind"], "name": reference["name"]},
        "metrics": {k: float(v) for k, v in metrics.items()},
        "isc_splits": kwargs["isc_splits"],
        "notes": notes,
    }


def extractor_weights(feature_extractor: str, weights: str | None) -> tuple[str | None, list[str]]:
    """The feature extractor's weights file (Inception's, found or fetched; the shapes extractor,
    registered with torch-fidelity here, brings its own) and the notes the record carries about it."""
    if feature_extractor != SHAPES:
        return inception_weights(weights), []
    from . import shapes_features

    shapes_features.register()
    note = (
        f"{SHAPES} features (tokenizer {shapes_features.weights_id()}): NOT Inception; detector class score = "
        "the IS formula over the shapes detector's 40 classes + none"
    )
    return None, [note]


def metrics_against_statistics(
    samples: Dataset, ref: str, reference: dict, isc: bool, prc: bool, notes: list[str], fidelity_kwargs: dict
) -> dict:
    """The metrics against a reference .npz of mu / sigma (ADM's, MAR's), from torch-fidelity's public
    parts: the samples' features, their statistics against the reference's, IS from the same
    features, and precision/recall where the .npz also holds its images (else a note says why not)."""
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
    from torch_fidelity.metric_isc import isc_features_to_metric
    from torch_fidelity.metric_prc import prc_features_to_metric
    from torch_fidelity.utils import create_feature_extractor, get_featuresdict_from_dataset

    kwargs = fidelity_kwargs
    feature_extractor, verbose = kwargs["feature_extractor"], kwargs["verbose"]
    layers = {"fid": "2048" if feature_extractor == INCEPTION else "vq_latent"}
    if isc:
        layers["isc"] = "logits_unbiased" if feature_extractor == INCEPTION else "detector_logits"
    if prc and reference["images"] is None:
        notes.append("no precision/recall: the reference .npz holds statistics only (no arr_0 images)")
        prc = False
    extractor = create_feature_extractor(feature_extractor, sorted(set(layers.values())), **kwargs)

    def features(dataset):
        return get_featuresdict_from_dataset(dataset, extractor, kwargs["batch_size"], kwargs["cuda"], True, verbose)

    feats = features(samples)
    stats = {k: v.astype(np.float64) for k, v in fid_features_to_statistics(feats[layers["fid"]]).items()}
    if stats["mu"].shape != reference["stats"]["mu"].shape:
        raise VisarError(
            f"reference statistics {ref} have {reference['stats']['mu'].shape[0]} dimensions, "
            f"{feature_extractor} gives {stats['mu'].shape[0]}: they come from another feature extractor"
        )
    metrics = fid_statistics_to_metric(stats, reference["stats"], verbose)
    if isc:
        metrics.update(isc_features_to_metric(feats[layers["isc"]], kwargs["isc_splits"]))
    if prc:
        ref_feats = features(ArrayDataset(reference["images"]))
        metrics.update(prc_features_to_metric(feats[layers["fid"]], ref_feats[layers["fid"]], **kwargs))
    return metrics


def format_metrics(record: dict) -> str:
    """One line: FID (or the shapes-world Frechet distance, labelled as such) and the rest."""
    m = record["metrics"]
    if record["feature_extractor"] == SHAPES:
        parts = [
            f"Frechet distance in {SHAPES} features (NOT Inception FID) {m['frechet_distance_visar_shapes_vq']:.4f}"
        ]
        if "detector_class_score_mean" in m:
            parts.append(
                f"detector class score {m['detector_class_score_mean']:.2f} +- {m['detector_class_score_std']:.2f}"
            )
        if "precision_visar_shapes_vq" in m:
            parts.append(f"precision {m['precision_visar_shapes_vq']:.3f}, recall {m['recall_visar_shapes_vq']:.3f}")
    else:
        parts = [f"FID {m['frechet_inception_distance']:.4f}"]
        if "inception_score_mean" in m:
            parts.append(f"IS {m['inception_score_mean']:.2f} +- {m['inception_score_std']:.2f}")
        if "precision" in m:
            parts.append(f"precision {m['precision']:.3f}, recall {m['recall']:.3f} (Inception features)")
    return "; ".join(parts) + f" against {record['reference']['name']}"


# -- the command -----------------------------------------------------------------------------------


def samples_from(images: str) -> tuple[Dataset, list[Path] | None]:
    """--images: a folder of images or an .npz with arr_0 -> (dataset, the files or None)."""
    path = Path(images)
    if path.is_dir():
        paths = folder_images(path, "--images folder")
        return ImageFilesDataset(paths), paths
    if path.is_file() and path.suffix == ".npz":
        data = read_npz(path)
        if "arr_0" not in data:
            raise VisarError(f"--images {path} has no arr_0")
        return ArrayDataset(check_image_array(data["arr_0"], f"--images {path}")), None
    raise VisarError(f"--images {images}: not a folder nor an .npz file")


def evaluate_fid(
    out: str | Path,
    *,
    pipe=None,
    n: int | None = None,
    images: str | None = None,
    ref: str | None = None,
    method: str = "ar",
    seed: int = 0,
    shard: tuple[int, int] = (0, 1),
    batch_size: int = 16,
    prompts: list[str] | None = None,
    identity: dict | None = None,
    generate_kwargs: dict | None = None,
    metric_kwargs: dict | None = None,
    progress: bool = True,
) -> dict:
    """Generate (resuming) or read the sample set, pack it, score it; returns the record written to metrics.json.

    With `pipe`: n images as the module docstring lays out (`identity`: settings recorded in
    OUT/config.json besides the model, dtype and conditions). With `images`: that folder or .npz.
    A shard other than 0/1 only generates its images. Without `ref`: no metrics.
    """
    out = Path(out)
    record: dict = {"out": str(out)}
    if images is not None:
        samples, paths = samples_from(images)
        record.update(images=str(images), n=len(samples))
    else:
        if pipe is None or n is None:
            raise VisarError("eval fid needs a model and --n, or --images")
        jobs = fid_jobs(pipe, out, n, seed=seed, shard=shard, prompts=prompts)
        ident = run_identity(pipe, {"method": method, "seed": seed, **(identity or {})}, prompts)
        start = time.perf_counter()
        with writing(out):
            config = out / "config.json"
            first = [job.condition for job in jobs[:batch_size]]
            decoding, kwargs, choice, _ = settled_method(
                pipe, method, first, batch_size, generate_kwargs or {}, recorded_choice(config)
            )
            check_run_config(config, {**ident, **choice})
            stats = generate_missing(
                pipe,
                jobs,
                method=decoding,
                batch_size=batch_size,
                progress=progress,
                desc=f"eval fid {method}",
                **kwargs,
            )
        record.update(model=pipe.name, method=method, n=n, shard=f"{shard[0]}/{shard[1]}", **stats, **choice)
        record["generation_s"] = time.perf_counter() - start
        if shard != (0, 1):
            return record
        paths = [sample_path(out, g) for g in range(n)]
        incomplete = [p for p in paths if not is_complete_png(p)]
        if incomplete:  # another process removed or truncated files meanwhile
            raise VisarError(f"{len(incomplete)} sample files are incomplete (first: {incomplete[0]}): run again")
        samples = ImageFilesDataset(paths)
    if paths is not None:
        npz = out / "samples.npz"
        width, height = check_same_size(paths, "the sample set")
        if npz_shape(npz) != (len(paths), height, width, 3):
            with writing(out):
                out.mkdir(parents=True, exist_ok=True)
                write_npz(paths, npz, (width, height))
        record["npz"] = str(npz)
    if ref is not None:
        record.update(compute_metrics(samples, ref, verbose=progress, **(metric_kwargs or {})))
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out / "metrics.json", record)
    return record


def read_prompts(metadata: str | Path | None) -> list[str]:
    """Prompts of a GenEval-format metadata file (default: the shipped shapes-world set)."""
    from .geneval import load_metadata

    return [entry["prompt"] for entry in load_metadata(metadata)]
