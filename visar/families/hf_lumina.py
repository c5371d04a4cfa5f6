"""The Lumina-mGPT family (Alpha-VLLM): Lumina-mGPT 1.0 and 2.0 generating images, as raster models.

A release folder (config.json with "architectures": ["ChameleonXLLMXForConditionalGeneration"], the
safetensors shards) loads with `visar.load(FOLDER)` or by Hub name (`visar.load("Alpha-VLLM/Lumina-mGPT-2.0")`).
The version is read from the vocabulary (1.0's has Chameleon's `IMGIMG` image tokens). What the
release folders lack is found as the official code finds it:
- the text tokenizer: the folder's own (2.0, 1.0's 7B-768), else 1.0's from `Alpha-VLLM/Lumina-mGPT-7B-768`
  (the official code always uses that one), or `model_args={"text_tokenizer": FOLDER_OR_HUB_NAME}`;
- the VQ: 1.0's Chameleon VQGAN (`vqgan.yaml` and `vqgan.ckpt`, from `Alpha-VLLM/Chameleon_7B_mGPT`
  `original_tokenizers/`, a re-host of Meta's gated files), 2.0's MoVQGAN 270M (`movqgan_270M.ckpt` from
  `ai-forever/MoVQGAN`); the folder's own copies if it has them, or `model_args={"vq": FOLDER}`.
Both VQs run as diffusers' `VQModel` (visar/tokenizers/taming_vq.py).

Load options (`model_args`): `width`, `height` (pixels, multiples of 32; default the release's size: 512, 768
or 1024 from the 1.0 repository name, 768 for 2.0), `max_prompt_tokens`
(default 256), `text_tokenizer`, `vq`, `version` (1 or 2, when the vocabulary does not say).

The generation protocol is the official vanilla `generate`'s (lumina_mgpt/inference_solver.py of both
repositories): the prompt `[BOS] "Generate an image of {W}x{H} according to the following prompt:\\n{prompt}"
<reserved08706>`, then the image header `<racm3:break>`, the height and the width in 32-pixel units
(`<reserved{8800 + n}>`), then H rows of W image tokens, each followed by the end-of-line token, and
`<eoss>`. The official code lets the model sample the header (text top-k 10, no guidance), the size in
the prompt being a hint; visar writes the requested header, because its grid is fixed per call. Sampling
the header and keeping only images of the requested size (rejection) has exactly this law, so visar's
images are the official law given the size asked for; a trained model emits the size it is asked for
(a random one never does, which is why the official fixtures append the header too). Guidance mixes
raw logits with an unconditional branch that is the header alone (see visar/models/hf_lumina.py), and
2.0's scale follows its processor's schedule. Defaults: 1.0 guidance 4, top-k 2000 (its README); 2.0
guidance 4, top-k 4096 (its README and sample.sh); temperature 1. The official code runs bf16 weights
under bf16 autocast; visar runs the dtype it is loaded in (`dtype="bf16"` for a 7B model on a GPU).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hub
from ..errors import VisarError
from ..models.hf_lumina import HFLumina
from ..models.hf_prompts import HFPromptEncoder
from ..tokenizers.taming_vq import TamingVQTokenizer, diffusers_state_dict, vq_model_config
from .family import Family, FolderParts, diffusers_module, register_family, transformers_module

ARCHITECTURES = ("ChameleonXLLMXForConditionalGeneration",)
START, END, EOL, SEP = "<racm3:break>", "<eoss>", "<reserved08799>", "<reserved08706>"
GRID_UNIT = 32  # pixels per grid unit of the header
TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}" + SEP
DEFAULT_MAX_PROMPT_TOKENS = 256
LOAD_OPTIONS = ("height", "max_prompt_tokens", "text_tokenizer", "version", "vq", "width")
MOVQ_IMAGE_OFFSET = 155000  # 2.0: image token id = 155000 + code (lumina_mgpt/data/item_processor.py)
# MoVQGAN's ddconfig is read from its checkpoint (`movq_params`); the released 270M file gives the config the
# official code hard-codes (Lumina-mGPT-2.0 lumina_mgpt/movqgan/__init__.py: ch 256, ch_mult [1, 2, 2, 4], 2 res
# blocks, attention at resolution 32 of 256, z 4, embed 4, 16,384 codes). Its nominal resolution places the
# attention levels.
MOVQ_RESOLUTION = 256


@dataclass(frozen=True)
class Version:
    number: int
    defaults: dict
    tokenizer_repo: str | None  # where the text tokenizer is when the folder has none
    vq_repo: str
    vq_files: tuple[str, ...]  # in vq_repo; a folder holding them by base name serves too


# The release repositories (1.0's sizes, then 2.0), as `visar models` lists them; their folders load by Hub name.
HUB_NAMES = (
    "Alpha-VLLM/Lumina-mGPT-7B-512",
    "Alpha-VLLM/Lumina-mGPT-7B-768",
    "Alpha-VLLM/Lumina-mGPT-7B-1024",
    "Alpha-VLLM/Lumina-mGPT-34B-512",
    "Alpha-VLLM/Lumina-mGPT-2.0",
)

VERSIONS = {
    1: Version(
        1,
        {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0},
        "Alpha-VLLM/Lumina-mGPT-7B-768",
        "Alpha-VLLM/Chameleon_7B_mGPT",
        ("original_tokenizers/vqgan.yaml", "original_tokenizers/vqgan.ckpt"),
    ),
    2: Version(
        2,
        {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 4096, "top_p": 1.0},
        None,
        "ai-forever/MoVQGAN",
        ("movqgan_270M.ckpt",),
    ),
}


def grid_token(units: int) -> str:
    return f"<reserved{8800 + units:05d}>"


def release_size(folder: Path, version: int) -> int:
    """1.0's repositories name their size (Lumina-mGPT-7B-512, -768, -1024); 2.0's is 768."""
    found = re.search(r"-(512|768|1024)(?:\b|-|$)", str(folder).replace("--", "-"))
    return int(found[1]) if found and version == 1 else 768


def image_size(options: dict, target: int) -> tuple[int, int]:
    """(width, height) in pixels: the release's square size unless given; multiples of the 32-pixel grid unit.
    The official code takes any size written in the prompt (the model samples its header); the releases
    were trained on the crop sizes of their target size (about target x target pixels, ratios up to 4:1)."""
    width = options.get("width", options.get("height", target))
    height = options.get("height", width)
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value < GRID_UNIT or value % GRID_UNIT:
            raise VisarError(
                f"{name} {value!r}: Lumina-mGPT generates sizes in {GRID_UNIT}-pixel grid units (e.g. {target}); "
                f"give a positive multiple of {GRID_UNIT}"
            )
    return width, height


# -- the language model ------------------------------------------------------------------------------------


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def lumina_version(config: dict, options: dict) -> int:
    if "version" in options:
        if options["version"] not in VERSIONS:
            raise VisarError(f"version {options['version']!r}: expected 1 (Lumina-mGPT) or 2 (Lumina-mGPT 2.0)")
        return int(options["version"])
    vocabulary = config.get("vocabulary_map") or {}
    return 1 if any(name.startswith("IMGIMG") for name in vocabulary) else 2


def chameleon_config(config: dict):
    """transformers' ChameleonConfig from Lumina's config.json (its extra keys are kept as attributes)."""
    transformers = transformers_module()
    kept = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")}
    return transformers.ChameleonConfig(**kept)


def empty_chameleon(config):
    """`ChameleonForConditionalGeneration` with no VQ module (the releases hold none), parameters on the meta
    device (the checkpoint's tensors are assigned), the rotary table built for real."""
    transformers = transformers_module()
    with torch.device("meta"):
        hf_model = transformers.ChameleonForConditionalGeneration(config)
    hf_model.model.vqmodel = None
    rotary = type(hf_model.model.rotary_emb)
    hf_model.model.rotary_emb = rotary(config=config)
    return hf_model


def repeat_qk_norms(state: dict, config) -> dict:
    """Lumina stores q_norm / k_norm as (model_parallel_size, head_dim), one row per shard of heads; transformers
    as (heads, head_dim): each row repeated for the heads of its shard (the official attention does the same)."""
    shards = int(getattr(config, "model_parallel_size", 1) or 1)
    heads = {"q_norm": config.num_attention_heads, "k_norm": config.num_key_value_heads}
    out = dict(state)
    for key, value in state.items():
        found = re.search(r"\.self_attn\.(q_norm|k_norm)\.(weight|bias)$", key)
        if found and value.dim() == 2 and value.shape[0] == shards:
            out[key] = value.repeat_interleave(heads[found[1]] // shards, dim=0)
    return out


def read_safetensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    missing = [f for f in files if not (folder / f).exists()]
    if not files or missing:
        raise VisarError(f"{folder} has no model weights (*.safetensors){f': missing {missing}' if missing else ''}")
    state = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def load_language_model(folder: Path, config: dict):
    """The release's transformer, loaded strictly into transformers' Chameleon classes, in the checkpoint's dtype
    (bf16 for the releases: `visar.load` then casts once to the dtype asked for, never through float32 copies)."""
    chameleon = chameleon_config(config)
    hf_model = empty_chameleon(chameleon)
    state = repeat_qk_norms(read_safetensors(folder), chameleon)
    try:
        hf_model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise VisarError(f"{folder}: the weights do not match a Lumina-mGPT of this config.json: {err}") from err
    return hf_model.eval()


# -- the text tokenizer and the prompt ------------------------------------------------------------------


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()


def text_tokenizer(folder: Path, version: Version, options: dict):
    """The folder's tokenizer, else `text_tokenizer` (a folder or Hub name), else the version's default repository."""
    transformers = transformers_module()
    source = options.get("text_tokenizer")
    if source is None and has_tokenizer(folder):
        source = folder
    if source is None and version.tokenizer_repo is not None:
        source = version.tokenizer_repo
    if source is None:
        missing = f"{folder} has no text tokenizer (tokenizer.json): pass"
        raise VisarError(
            f"{missing} model_args={{'text_tokenizer': FOLDER_OR_HUB_NAME}}",
            cli=f"{missing} --model-arg text_tokenizer=FOLDER_OR_HUB_NAME",
        )
    if not Path(str(source)).is_dir():
        if not hub.is_hub_name(str(source)):
            raise VisarError(f"text_tokenizer {source!r}: not a folder nor a Hub name (owner/name)")
        source = fetch_tokenizer(str(source))
    if not has_tokenizer(Path(source)):
        raise VisarError(f"{source} holds no text tokenizer (tokenizer.json / tokenizer_config.json)")
    return transformers.AutoTokenizer.from_pretrained(str(source), local_files_only=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def fetch_tokenizer(repo_id: str) -> Path:
    """A Hub repository's tokenizer files only (a release repository also holds 14 GB of weights)."""
    files = ", ".join(TOKENIZER_FILES)
    local = hub.LocalForm(
        f"model_args={{'text_tokenizer': FOLDER}} with {files}", f"--model-arg text_tokenizer=FOLDER with {files}"
    )
    paths = [hub.fetch_file(repo_id, name, None, local) for name in TOKENIZER_FILES]
    try:  # optional: older tokenizers keep their special tokens here
        hub.fetch_file(repo_id, "special_tokens_map.json", None, local)
    except VisarError:
        pass
    return Path(paths[0]).parent


def token_id(tokenizer, name: str) -> int:
    found = tokenizer.get_vocab().get(name)
    if found is None:
        raise VisarError(f"the text tokenizer has no {name} token: it is not a Lumina-mGPT tokenizer")
    return int(found)


class LuminaPromptEncoder(HFPromptEncoder):
    """Prompts as the official item processor writes them for image generation ([BOS] + the template,
    encoded without special tokens), then the header; left-padded to the model's T condition positions.
    A negative prompt is written the same way (it replaces the header-only unconditional branch)."""

    def __init__(self, tokenizer, max_tokens: int, size: tuple[int, int], header_ids: list[int]):
        super().__init__(tokenizer, max_tokens, pad_token_id=0, chat=False)
        self.size, self.header_ids = size, list(header_ids)
        bos = tokenizer.bos_token_id
        self.bos_id = tokenizer.eos_token_id if bos is None else bos  # xllmx's Tokenizer: eos when there is no bos

    def format(self, prompt: str) -> str:
        width, height = self.size
        return TEMPLATE.format(width=width, height=height, prompt=prompt)

    def tokenize(self, texts: list[str], call_kwargs: dict, what: str):
        rows = [[self.bos_id, *self.processor.encode(t, add_special_tokens=False), *self.header_ids] for t in texts]
        longest = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[False] * (longest - len(r)) + [True] * len(r) for r in rows])
        return self.fit(ids, mask, what)


# -- the VQ ------------------------------------------------------------------------------------------------


def vq_files(folder: Path, version: Version, options: dict) -> list[Path]:
    """The VQ's files: in `vq` (a folder), else in the model folder, else from the version's Hub repository."""
    names = [Path(f).name for f in version.vq_files]
    for place in [options.get("vq"), folder]:
        if place is not None and all((Path(place) / n).exists() for n in names):
            return [Path(place) / n for n in names]
    if options.get("vq") is not None:
        raise VisarError(f"vq {options['vq']}: expected a folder holding {', '.join(names)}")
    files = ", ".join(names)
    local = hub.LocalForm(f"model_args={{'vq': FOLDER}} with {files}", f"--model-arg vq=FOLDER with {files}")
    return [hub.fetch_file(version.vq_repo, f, None, local) for f in version.vq_files]


def read_vq_checkpoint(path: Path) -> dict:
    checkpoint = torch.load(str(path), map_location="cpu", weights_only=True)
    return checkpoint.get("state_dict", checkpoint)  # taming's Lightning checkpoint, or MoVQ's bare state dict


def build_vq(params: dict, spatial: bool):
    """diffusers' VQModel for a taming ddconfig / n_embed / embed_dim (spatial: MoVQ's decoder norms)."""
    diffusers = diffusers_module()
    config = vq_model_config(params["ddconfig"], params["n_embed"], params["embed_dim"], spatial)
    return diffusers.VQModel(**config)


def movq_params(state: dict) -> dict:
    """MoVQGAN's ddconfig, n_embed and embed_dim read from its checkpoint's shapes (the 270M config for the
    released file, see MOVQ_RESOLUTION); attention where the encoder has it."""
    levels = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.down."))
    ch = state["encoder.conv_in.weight"].shape[0]
    ch_mult = [state[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch for i in range(levels)]
    blocks = {k.split(".")[4] for k in state if k.startswith("encoder.down.0.block.")}
    resolution = MOVQ_RESOLUTION
    attention = [resolution // 2**i for i in range(levels) if f"encoder.down.{i}.attn.0.q.weight" in state]
    n_embed, embed_dim = state["quantize.embedding.weight"].shape
    z_channels = state["encoder.conv_out.weight"].shape[0]
    ddconfig = dict(z_channels=z_channels, resolution=resolution, ch=ch, ch_mult=ch_mult, num_res_blocks=len(blocks))
    return dict(ddconfig={**ddconfig, "attn_resolutions": attention}, n_embed=n_embed, embed_dim=embed_dim)


def load_vq(files: list[Path], version: int) -> TamingVQTokenizer:
    """1.0: the VQGAN its vqgan.yaml describes (as the official loader reads it); 2.0: MoVQGAN."""
    try:
        if version == 1:
            import yaml

            params = yaml.safe_load(files[0].read_text())["model"]["params"]
            state = read_vq_checkpoint(files[1])
        else:
            state = read_vq_checkpoint(files[0])
            params = movq_params(state)
    except (KeyError, ValueError, TypeError, OSError) as err:
        raise VisarError(f"{files[-1]}: not the VQ of Lumina-mGPT {version} ({type(err).__name__}: {err})") from err
    vq = build_vq(params, spatial=version == 2)
    levels = len(params["ddconfig"]["ch_mult"])
    try:
        vq.load_state_dict(diffusers_state_dict(state, levels, version == 2), strict=True)
    except RuntimeError as err:
        raise VisarError(f"{files[-1]}: not the VQ of Lumina-mGPT {version}: {err}") from err
    return TamingVQTokenizer(vq.eval(), pixel_rounding="floor" if version == 1 else "round")


# -- the model ---------------------------------------------------------------------------------------------


def visual_ids(hf_model, version: int, codes: int) -> torch.Tensor:
    """The text-vocabulary id of each VQ code: 1.0 by the `IMGIMG` token's name, 2.0 at 155000 + code."""
    if version == 1:
        return hf_model.model.vocabulary_mapping.img2bpe_mapping_tensor.long()[:codes]
    return MOVQ_IMAGE_OFFSET + torch.arange(codes)


def header_ids(tokenizer, size: tuple[int, int]) -> list[int]:
    """`<racm3:break>`, the height and the width in grid units, for (width, height) pixels."""
    width, height = size
    vocabulary = tokenizer.get_vocab()
    units = [n // GRID_UNIT for n in (height, width)]
    missing = [grid_token(u) for u in units if grid_token(u) not in vocabulary]
    if missing:
        raise VisarError(f"{width}x{height}: the text tokenizer has no header token {missing[0]} for this size")
    return [token_id(tokenizer, START), *(vocabulary[grid_token(u)] for u in units)]


def build_lumina(hf_model, tokenizer, version: int, size: tuple[int, int], vq: tuple[int, int], options: dict):
    """The adapter and its prompt encoder for (width, height) pixels; vq: (pixels per token, codes)."""
    width, height = size
    downsampling, codes = vq
    grid = (height // downsampling, width // downsampling)
    max_prompt_tokens = int(options.get("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS))
    context = getattr(hf_model.config, "max_position_embeddings", None)
    needed = max_prompt_tokens + grid[0] * (grid[1] + 1)
    if context is not None and needed > context:
        raise VisarError(
            f"{width}x{height} with {max_prompt_tokens} prompt tokens needs {needed} positions, more than this "
            f"model's context of {context}: a smaller size or max_prompt_tokens"
        )
    header = header_ids(tokenizer, size)
    model = HFLumina(
        hf_model,
        version=version,
        max_prompt_tokens=max_prompt_tokens,
        grid_size=grid,
        grid_units=(height // GRID_UNIT, width // GRID_UNIT),
        visual_ids=visual_ids(hf_model, version, codes),
        eol_token_id=token_id(tokenizer, EOL),
        header_ids=header,
    )
    return model, LuminaPromptEncoder(tokenizer, max_prompt_tokens, size, header)


def load_folder(folder: os.PathLike, model_args: dict | None = None) -> FolderParts:
    """A Lumina-mGPT release folder -> model (the checkpoint's dtype), VQ tokenizer, prompt encoder, defaults."""
    folder, options = Path(folder), dict(model_args or {})
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        what = f"{unknown} for a Lumina-mGPT folder; known: {list(LOAD_OPTIONS)}"
        raise VisarError(f"unknown model_args {what}", cli=f"unknown --model-arg {what}")
    config = read_config(folder)
    version = VERSIONS[lumina_version(config, options)]
    size = image_size(options, release_size(folder, version.number))
    tokenizer = text_tokenizer(folder, version, options)
    vq = load_vq(vq_files(folder, version, options), version.number)
    hf_model = load_language_model(folder, config)
    model, encoder = build_lumina(hf_model, tokenizer, version.number, size, (vq.downsampling, vq.vocab_size), options)
    return FolderParts(model, vq, encoder, dict(version.defaults))


def load_weights_elsewhere(module, path, source: str):
    loads = f"{source}: a Lumina-mGPT model loads from its release folder or Hub name:"
    raise VisarError(f"{loads} visar.load(FOLDER)", cli=f"{loads} --model FOLDER")


# -- tiny random Lumina-mGPTs, for the tests (tests/accel/test_method_conformance.py, tests/models/test_hf_lumina.py) --

TINY_WORDS = ["Generate", "an", "image", "of", "according", "to", "the", "following", "prompt", ":", "a", "red"]
TINY_WORDS += ["green", "blue", "circle", "square", "dog", "on", "in", "lowres", "blurry", ","]
TINY_WORDS += [f"{w}x{h}" for w in (32, 64, 96) for h in (32, 64, 96)]
TINY_SPECIALS = [START, END, EOL, SEP] + [grid_token(n) for n in range(1, 9)]
TINY_V2_IDS = {START: 151665, END: 151666, EOL: 151670}  # 2.0's ids (the others: free ids below 155000)


def image_token_name(code: int) -> str:
    """Chameleon's name of image code k: its digits as letters A-J, between IMGIMG and Z."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def tiny_vocabulary(version: int, image_vocab: int) -> dict[str, int]:
    """Words and the Lumina tokens; 1.0: image tokens named for their codes in reverse id order (so a code
    is read from the name, never from the id), 2.0: the image ids 155000 + code have no names."""
    names = ["<unk>", "<s>", "</s>"]
    if version == 1:
        names += [image_token_name(code) for code in reversed(range(image_vocab))]
    names += [n for n in TINY_SPECIALS if version == 1 or n not in TINY_V2_IDS] + TINY_WORDS
    vocabulary = {name: i for i, name in enumerate(names)}
    if version == 2:
        vocabulary.update(TINY_V2_IDS)
    return vocabulary


def tiny_tokenizer(version: int, image_vocab: int):
    """A word-level transformers tokenizer over the tiny vocabulary (BOS <s>), Lumina's tokens special."""
    transformers = transformers_module()
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = tiny_vocabulary(version, image_vocab)
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([n for n in vocabulary if n.startswith("<") and len(n) > 1])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_config(version: int, image_vocab: int = 8) -> dict:
    """A Lumina config.json's LM part: 2 layers, qk-norm, the tiny vocabulary, a tiny VQ config (transformers
    builds one; visar removes it). 1.0: 32 wide, 4 heads; 2.0: 16 wide, 2 heads, since its vocabulary runs up
    to its image ids (155,008 rows)."""
    vocabulary = tiny_vocabulary(version, image_vocab)
    size = max(vocabulary.values()) + 1 if version == 1 else MOVQ_IMAGE_OFFSET + image_vocab
    hidden, heads = (32, 4) if version == 1 else (16, 2)
    return dict(
        architectures=list(ARCHITECTURES),
        model_type="chameleon",
        vocab_size=size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        vocabulary_map=vocabulary,
        vq_config=dict(embed_dim=4, num_embeddings=image_vocab, base_channels=32, channel_multiplier=[1, 1]),
        model_parallel_size=1,
        mask_image_logits=False,
    )


def tiny_vq_params(image_vocab: int = 8, levels: int = 5, spatial: bool = False) -> dict:
    """A taming ddconfig with n_embed / embed_dim: 2 ** (levels - 1) pixels per token, attention at the
    lowest resolution of a 32-pixel image under 2.0's spatial norms (as MoVQ 270M has it)."""
    lowest = 32 // 2 ** (levels - 1)
    ddconfig = dict(z_channels=4, resolution=32, ch=32, ch_mult=[1] * levels, num_res_blocks=1)
    ddconfig["attn_resolutions"] = [lowest] if spatial else []
    return dict(ddconfig=ddconfig, n_embed=image_vocab, embed_dim=4, spatial=spatial)


def build_tiny_vq(tokenizer_args: dict) -> TamingVQTokenizer:
    args = dict(tokenizer_args)
    spatial = args.pop("spatial")
    return TamingVQTokenizer(build_vq(args, spatial).eval())


def tiny_size(model_args: dict) -> tuple[int, int]:
    return int(model_args.get("width", 32)), int(model_args.get("height", model_args.get("width", 32)))


def build_model(model_args: dict) -> HFLumina:
    """A random Lumina-mGPT over the tiny vocabulary (the tests' model; releases load from folders).
    model_args: "version", "image_vocab", "downsampling" (pixels per token), "config" (tiny_config's
    overrides), and load options (width, height, max_prompt_tokens)."""
    transformers = transformers_module()
    options = dict(model_args)
    version, image_vocab = options.pop("version"), options.pop("image_vocab")
    downsampling = options.pop("downsampling")
    config = chameleon_config({**tiny_config(version, image_vocab), **options.pop("config", {})})
    hf_model = transformers.ChameleonForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    hf_model.model.vqmodel = None
    tokenizer = tiny_tokenizer(version, image_vocab)
    return build_lumina(hf_model.eval(), tokenizer, version, tiny_size(options), (downsampling, image_vocab), options)[
        0
    ]


def build_text_encoder(text_encoder_args: dict) -> LuminaPromptEncoder:
    """The tiny tokenizer as a prompt encoder (text_encoder_args: the tiny model's model_args)."""
    args = text_encoder_args
    tokenizer = tiny_tokenizer(args["version"], args["image_vocab"])
    size = tiny_size(args)
    return LuminaPromptEncoder(tokenizer, args["max_prompt_tokens"], size, header_ids(tokenizer, size))


def tiny_model_args(version: int, width: int = 64, height: int = 64) -> dict:
    downsampling = 16 if version == 1 else 8
    return dict(
        version=version, image_vocab=8, downsampling=downsampling, width=width, height=height, max_prompt_tokens=24
    )


# Release folders of both versions load through the first registration (the version is read from the
# vocabulary); the second exists so that the registry-driven tests also run 2.0's scheduled guidance and
# its numbered image ids under every method.
for number, name in ((1, "hf-lumina-mgpt"), (2, "hf-lumina-mgpt-2")):
    register_family(
        Family(
            name=name,
            model_kind="raster",
            build_model=build_model,
            load_model_weights=load_weights_elsewhere,
            build_tokenizer=build_tiny_vq,
            load_tokenizer_weights=load_weights_elsewhere,
            official_presets={},
            tiny_model_args=tiny_model_args(number, *((64, 64) if number == 1 else (32, 32))),
            tiny_tokenizer_args=tiny_vq_params(levels=5 if number == 1 else 4, spatial=number == 2),
            architectures=ARCHITECTURES if number == 1 else (),
            title="Lumina-mGPT 1.0 and 2.0" if number == 1 else None,
            hub_names=HUB_NAMES if number == 1 else (),
            extra="hf",
            load_folder=load_folder if number == 1 else None,
            build_text_encoder=build_text_encoder,
            tiny_text_encoder_args=tiny_model_args(number, *((64, 64) if number == 1 else (32, 32))),
        )
    )
