"""`visar-shapes-vq`: an offline, CPU-friendly torch-fidelity feature extractor for the shapes world.

Its numbers are NOT Inception FID / IS and are comparable only with other numbers from this
extractor (and the same tokenizer weights, whose hash `weights_id` gives). Two feature layers:

- `vq_latent` [B, 128], used for FID, KID and precision/recall: the shipped `visar-tiny-vq`
  tokenizer's encoder, pre-quantisation latents average-pooled to 4x4 and flattened (the same
  feature space as `visar bench`'s Frechet column, with a fixed tokenizer instead of the model's
  own). Trained on the shapes world, it sees layout, shape and colour.
- `detector_logits` [B, 41], used for the Inception-Score formula: the shapes detector's class
  (shape and colour of the largest object, `label_of`) or 40 for "no object", as logits 0 for
  that class and -`LOGIT_GAP` for the others. With these near one-hot rows the IS formula gives
  exp(H(class marginal)): the effective number of distinct classes seen, at most 41 (40 for a
  perfect, class-balanced class-conditional run). Visar reports it as the "detector class
  score", never as an Inception Score.

Images of any size are resized to 64x64 (the world's size) before either layer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import torch_fidelity
from torch_fidelity.helpers import vassert
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

from ..data.shapes import IMAGE_SIZE, NUM_CLASSES, label_of
from ..registry import WEIGHTS_DIR
from .bench import pooled_latents

NAME = "visar-shapes-vq"
TOKENIZER_DIR = WEIGHTS_DIR / "visar-tiny-vq"
LOGIT_GAP = 20.0  # logit of the detected class over the others: p(other) ~ 2e-9, so log q stays finite


def load_shapes_tokenizer(folder: str | Path | None = None):
    """The VQ tokenizer whose encoder gives `vq_latent` (a folder with tokenizer.json + tokenizer.safetensors)."""
    from ..families import get_family

    family = get_family("llamagen")  # visar's shapes-world VQ is LlamaGen's VQ
    folder = Path(folder) if folder is not None else TOKENIZER_DIR
    config = json.loads((folder / "tokenizer.json").read_text())
    tokenizer = family.build_tokenizer(config["vq_args"])
    weights = folder / "tokenizer.safetensors"
    return family.load_tokenizer_weights(tokenizer, weights, f"shapes feature tokenizer {weights}").eval()


def weights_id(folder: str | Path | None = None) -> str:
    """First 12 hex digits of the tokenizer weights' sha256: numbers are comparable only under the same id."""
    folder = Path(folder) if folder is not None else TOKENIZER_DIR
    return hashlib.sha256((folder / "tokenizer.safetensors").read_bytes()).hexdigest()[:12]


def detected_class(image) -> int:
    """Class id of the largest detected object in an [H, W, 3] uint8 image, or NUM_CLASSES for none."""
    from .detector import detect, largest

    main = largest(detect(image))
    return NUM_CLASSES if main is None else label_of(main.shape, main.color)


class ShapesFeatureExtractor(torch_fidelity.FeatureExtractorBase):
    """torch-fidelity extractor `visar-shapes-vq`; feature_extractor_weights_path: another tokenizer folder."""

    def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
        super().__init__(name, features_list)
        self.tokenizer = load_shapes_tokenizer(feature_extractor_weights_path)
        self.requires_grad_(False)

    @staticmethod
    def get_provided_features_list():
        return "vq_latent", "detector_logits"

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return {"isc": "detector_logits", "fid": "vq_latent", "kid": "vq_latent", "prc": "vq_latent"}[metric]

    @staticmethod
    def can_be_compiled():
        return False  # the detector half runs in numpy

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)

    @torch.no_grad()
    def forward(self, x):
        vassert(torch.is_tensor(x) and x.dtype == torch.uint8, "Expecting image as torch.Tensor with dtype=torch.uint8")
        vassert(x.dim() == 4 and x.shape[1] == 3, f"Input is not Bx3xHxW: {x.shape}")
        images = x.float() / 127.5 - 1  # [B, 3, H, W] in [-1, 1]
        if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
            images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True)
        features = {}
        if "vq_latent" in self.features_list:
            features["vq_latent"] = pooled_latents(self.tokenizer, images).float()
        if "detector_logits" in self.features_list:
            pixels = ((images + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 1).cpu().numpy()
            labels = torch.tensor([detected_class(image) for image in pixels], device=x.device)  # [B]
            logits = torch.full((x.shape[0], NUM_CLASSES + 1), -LOGIT_GAP, device=x.device)
            features["detector_logits"] = logits.scatter(1, labels[:, None], 0.0)
        return tuple(features[name] for name in self.features_list)


def register() -> None:
    """Register `visar-shapes-vq` with torch-fidelity (once per process)."""
    if NAME not in FEATURE_EXTRACTORS_REGISTRY:
        torch_fidelity.register_feature_extractor(NAME, ShapesFeatureExtractor)
