"""A model family's registration record, and the registry of families (see visar/families/__init__.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..errors import VisarError, install_command
from ..hub import CONVERTED

WeightLoader = Callable[[nn.Module, "str | os.PathLike", str], nn.Module]


@dataclass
class FolderParts:
    """What a family that reads a whole folder its own way (a transformers `save_pretrained` folder)
    gives the pipeline: the model, its tokenizer, its text encoder, sampling defaults and class names."""

    model: nn.Module
    tokenizer: nn.Module | None
    text_encoder: object | None = None
    defaults: dict = field(default_factory=dict)
    class_names: list[str] | None = None


@dataclass(frozen=True)
class OfficialPreset:
    """A released checkpoint layout: the family's constructor arguments and its sampling defaults.

    hub_repo / hub_files: the Hugging Face repository its authors publish the release in and the file
    names of the checkpoint and its tokenizer there (`visar.load(name)` fetches them); release_note:
    where the files are instead, for a release not on the Hub."""

    name: str
    family: str
    description: str
    model_args: dict
    tokenizer_args: dict
    defaults: dict = field(default_factory=dict)
    hub_repo: str | None = None
    hub_files: tuple[str, str] | None = None
    release_note: str = ""
    text_encoder: str | None = None  # the prompt encoder it was trained with (Hub name), loaded on first use


@dataclass(frozen=True)
class Family:
    name: str
    model_kind: str  # the interface its models implement (visar.models.base)
    build_model: Callable[[dict], nn.Module]
    load_model_weights: WeightLoader
    build_tokenizer: Callable[[dict], nn.Module]
    load_tokenizer_weights: WeightLoader
    official_presets: dict[str, OfficialPreset]
    tiny_model_args: dict
    tiny_tokenizer_args: dict
    generic_name: str | None = None  # visar.load(generic_name, checkpoint=, model_args=) for any size
    generic_description: str = ""
    # What `visar models` says of it: the name its authors give it (None: not listed, as a registration whose
    # folders load through another one), the Hub repositories holding its folders that visar knows (beside
    # its presets' files; any other of the family loads too), and the extra of pyproject.toml it needs.
    title: str | None = None
    hub_names: tuple[str, ...] = ()
    extra: str | None = None
    # Families over a transformers model: the architectures it loads (config.json "architectures",
    # for `recognises` and error messages), `load_folder(folder, model_args)` for a save_pretrained
    # folder, and a prompt encoder (`build_text_encoder(text_encoder_args)`, tiny args for the tests).
    architectures: tuple[str, ...] = ()
    # Families over a diffusers pipeline folder (model_index.json "_class_name", e.g. AmusedPipeline).
    pipeline_classes: tuple[str, ...] = ()
    load_folder: Callable[[os.PathLike, dict], FolderParts] | None = None
    build_text_encoder: Callable[[dict], object] | None = None
    tiny_text_encoder_args: dict = field(default_factory=dict)
    # (model, tokenizer) -> None, or one VisarError when the tokenizer cannot decode the model's tokens.
    check_tokenizer: Callable[[nn.Module, nn.Module], None] | None = None
    # (model_args as given, model_args merged with the preset's, tokenizer_args) -> the model_args with what
    # the model takes from its tokenizer (VAR: vocabulary and latent width), or one VisarError on a conflict.
    args_from_tokenizer: Callable[[dict, dict, dict], dict] | None = None
    # (Hub name or folder, model) -> a prompt encoder for the model's captions (`text_encoder=` of visar.load).
    load_text_encoder: Callable[[str, nn.Module], object] | None = None

    def recognises(self, config: dict) -> bool:
        """Is this config.json a transformers config of one of this family's architectures, or this
        model_index.json a diffusers pipeline of one of its pipeline classes?"""
        if "_class_name" in config:
            return config["_class_name"] in self.pipeline_classes
        return bool(set(config.get("architectures") or ()) & set(self.architectures))


FAMILIES: dict[str, Family] = {}


def register_family(family: Family):
    FAMILIES[family.name] = family


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise VisarError(f"unknown model family {name!r}; registered families: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def hf_family(config: dict) -> Family:
    """The family of a transformers config.json or a diffusers model_index.json (no visar "family" key), or
    one sentence naming what loads."""
    for family in FAMILIES.values():
        if family.recognises(config):
            return family
    if "_class_name" in config:
        pipelines = sorted(c for f in FAMILIES.values() for c in f.pipeline_classes)
        what = config["_class_name"]
        if config.get("_source") == "config.json":
            raise VisarError(
                f"this folder holds one diffusers component ({what}), not a pipeline: pass the pipeline's folder "
                f"(the one with model_index.json); visar loads diffusers folders of {', '.join(pipelines)}"
            )
        raise VisarError(
            f"this folder holds a diffusers {what}, which visar cannot generate images with: visar loads "
            f"diffusers pipeline folders of {', '.join(pipelines)}"
        )
    supported = sorted(a for f in FAMILIES.values() for a in f.architectures)
    found = ", ".join(config.get("architectures") or ()) or config.get("model_type", "unknown")
    raise VisarError(
        f"this folder holds a transformers {found} model, which visar cannot generate images with: visar loads "
        f'transformers folders of {", ".join(supported)} (and its own folders with a "family" key)'
    )


TESTED_TRANSFORMERS = "transformers>=5.24,<6"


def transformers_module():
    """transformers, imported when a Hugging Face family builds a model (an optional dependency)."""
    try:
        import transformers
    except ImportError as err:
        raise VisarError(
            f"Hugging Face models need transformers: install the hf extra with `{install_command('hf')}` "
            f"({TESTED_TRANSFORMERS})"
        ) from err
    return transformers


TESTED_DIFFUSERS = "diffusers>=0.42,<0.43"


def diffusers_module():
    """diffusers, imported when a diffusers family builds a model (an optional dependency, with transformers)."""
    transformers_module()
    try:
        import diffusers
    except ImportError as err:
        raise VisarError(
            f"aMUSEd models need diffusers: install the hf extra with `{install_command('hf')}` ({TESTED_DIFFUSERS}, "
            f"{TESTED_TRANSFORMERS})"
        ) from err
    return diffusers


def original_names(family: Family) -> list[str]:
    """The original-format repositories whose conversion is one of the family's Hub names (`hub.CONVERTED`):
    a load by one of them fetches the conversion."""
    return [original for original, converted in CONVERTED.items() if converted in family.hub_names]


def folder_formats(family: Family) -> str:
    """The folders the family reads: transformers ones by architecture, diffusers pipelines by class, else visar's."""
    if family.architectures:
        return f"folders whose config.json names {', '.join(family.architectures)} (transformers)"
    if family.pipeline_classes:
        return f"diffusers pipeline folders of {', '.join(family.pipeline_classes)}"
    return f'visar folders whose config.json says "family": "{family.name}"'


def official_presets() -> dict[str, OfficialPreset]:
    """Every registered family's released checkpoints, by name."""
    return {name: preset for family in FAMILIES.values() for name, preset in family.official_presets.items()}


def generic_names() -> dict[str, Family]:
    """Names that load any checkpoint of a family from its constructor arguments (e.g. "llamagen")."""
    return {f.generic_name: f for f in FAMILIES.values() if f.generic_name}
