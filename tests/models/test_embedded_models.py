"""The models shipped inside the package: they load strictly, stay small, record their recipe, and work."""

import json
import shutil

import pytest
import torch

import visar
from visar.registry import DEFAULT_MODEL, WEIGHTS_DIR, embedded_models
from visar.train import recipes

TRAINED = ["visar-tiny-c2i", "visar-tiny-c2i-causal", "visar-tiny-c2i-draft", "visar-tiny-t2i"]


def test_default_is_the_trained_class_conditional_model():
    assert DEFAULT_MODEL == "visar-tiny-c2i"
    assert visar.load("default", device="cpu").name == "visar-tiny-c2i"


def test_shipped_weights_are_small_fp16_and_reproducible_by_recipe():
    files = [p for p in WEIGHTS_DIR.rglob("*.safetensors")]
    assert sum(p.stat().st_size for p in files) < 40 * 2**20
    for name in TRAINED:
        config = json.loads((embedded_models()[name] / "config.json").read_text())
        assert config["recipe"]["name"] == name and "seed" in config["recipe"]
        assert config["tokenizer_recipe"]["name"] == "visar-tiny-vq"
    from safetensors.torch import load_file

    assert all(t.dtype == torch.float16 for p in files for t in load_file(str(p)).values())


def test_every_embedded_folder_is_self_contained():
    """Each folder names only its own files (it loads when copied alone, or published on the Hub), and its
    tokenizer is byte for byte the one in the folder of its tokenizer recipe (which training and the
    shapes-world features read)."""
    for name, folder in embedded_models().items():
        config = json.loads((folder / "config.json").read_text())
        for file in config.get("weights", {}).values():
            assert "/" not in file and (folder / file).is_file(), (name, file)
        if "tokenizer" in config.get("weights", {}):
            shared = WEIGHTS_DIR / config["tokenizer_recipe"]["name"] / "tokenizer.safetensors"
            assert (folder / config["weights"]["tokenizer"]).read_bytes() == shared.read_bytes(), name


def test_ship_writes_a_self_contained_folder(tmp_path):
    """`visar train ship` on an export (here an embedded folder, laid out as one) copies every file the
    config names into the new folder, and the tokenizer again into the recipe's tokenizer folder."""
    from visar.apps.commands.train import ship

    export = tmp_path / "export"
    shutil.copytree(embedded_models()["visar-tiny-c2i"], export)
    target = ship(export, "shipped", "a copy", weights_dir=tmp_path / "weights")
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.safetensors"]
    assert json.loads((target / "config.json").read_text())["weights"]["tokenizer"] == "tokenizer.safetensors"
    shared = tmp_path / "weights" / "visar-tiny-vq"
    assert (shared / "tokenizer.safetensors").read_bytes() == (export / "tokenizer.safetensors").read_bytes()
    assert (shared / "tokenizer.json").is_file()
    moved = shutil.move(target, tmp_path / "elsewhere")  # no sibling folder to lean on
    a = visar.load(str(moved), device="cpu").generate(class_labels=[13], seed=5, output_type="np")
    b = visar.load("visar-tiny-c2i", device="cpu").generate(class_labels=[13], seed=5, output_type="np")
    assert torch.equal(a.tokens, b.tokens) and (a.images == b.images).all()


def test_draft_is_at_most_a_quarter_of_the_target():
    target = visar.load("visar-tiny-c2i", device="cpu").model
    draft = visar.load("visar-tiny-c2i-draft", device="cpu").model
    assert draft.num_parameters() * 4 <= target.num_parameters()
    assert draft.vocab_size == target.vocab_size and draft.grid_size == target.grid_size


@pytest.mark.parametrize("name", TRAINED)
def test_trained_models_load_and_generate(name):
    pipe = visar.load(name, device="cpu")
    kwargs = {"class_labels": [0, 13]} if pipe.is_class_conditional else {"prompts": ["a photo of a blue square"] * 2}
    out = pipe.generate(**kwargs, output_type="np")
    assert out.images.shape == (2, 64, 64, 3)


def test_t2i_prompts_outside_the_vocabulary_warn_once_and_generate():
    pipe = visar.load("visar-tiny-t2i", device="cpu")
    prompt = "a photo of a violet dog"
    with pytest.warns(UserWarning, match="'violet', 'dog'") as record:
        pipe.generate(prompts=[prompt, "a photo of a dog"], output_type="tokens")
    assert len([w for w in record if "does not know" in str(w.message)]) == 1
    long = " ".join(["a photo of a red circle"] * 5)  # 30 words: cut to the encoder's 16
    with pytest.warns(UserWarning, match="30 words was cut"):
        out = pipe.generate(prompts=[long, prompt], output_type="tokens")  # 'dog' is not named again
    assert out.tokens.shape == (2, 16, 16)


RECIPES = {
    name: recipe
    for table in (
        recipes.TOKENIZER_RECIPES,
        recipes.MSVQ_RECIPES,
        recipes.KL_RECIPES,
        recipes.AR_RECIPES,
        recipes.MASKED_RECIPES,
        recipes.NEXT_SCALE_RECIPES,
        recipes.MAR_RECIPES,
    )
    for name, recipe in table.items()
}


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_is_what_its_shipped_model_records(name):
    """`visar train ... --recipe NAME` reproduces what ships: the recipe (the base with the model's
    overrides, visar/train/recipes.py) holds exactly the fields, model arguments and sampling defaults
    that its shipped model (config.json) or tokenizer (tokenizer.json) recorded when it was trained."""
    recipe = json.loads(json.dumps(RECIPES[name]))  # tuples -> lists, as the records store them
    folder = WEIGHTS_DIR / name
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
        recorded = {**config["recipe"], "model_args": config["model_args"], "defaults": config["defaults"]}
    else:
        recorded = json.loads((folder / "tokenizer.json").read_text())["recipe"]
    assert {k: v for k, v in recorded.items() if k != "name"} == recipe


@pytest.mark.slow
def test_default_model_follows_its_class():
    """The trained default draws the class's shape and colour far above chance (2.5%): 73.0% at
    n = 500. At a true 73%, 80 images fall below 60% with probability 0.4% (the draw is seeded:
    a pass or a failure repeats)."""
    from visar.eval.shapes_eval import evaluate_shapes

    record = evaluate_shapes(visar.load("default", device="cpu"), n=80, batch_size=40, progress=False)
    assert record["accuracy"] >= 0.60


@pytest.mark.slow  # a quality test of the shipped models
@torch.no_grad()
def test_zipar_aware_model_predicts_better_from_zipar_contexts():
    """The default was trained on the contexts zipar gives (lag masks): on held-out renders its
    next-token loss under those masks is lower than the causal model's, and the masks matter to it less."""
    import torch.nn.functional as F

    from visar.data.shapes import class_render_options, render_class
    from visar.models.lag_mask import lag_training_mask
    from visar.train.loop import images_to_tensor
    from visar.train.recipes import AR_RECIPES

    render = class_render_options(AR_RECIPES["visar-tiny-c2i"])
    labels = torch.arange(0, 40, 3)  # 14 classes, renders no recipe trains on
    causal, aware = visar.load("visar-tiny-c2i-causal", device="cpu"), visar.load("visar-tiny-c2i", device="cpu")
    images = [render_class(int(c), 424_242 + i, **render).image for i, c in enumerate(labels)]
    codes = aware.tokenizer.encode(images_to_tensor(images)).reshape(len(labels), -1)

    def loss(pipe, s):
        model = pipe.model
        mask = lag_training_mask(model.grid_size, s, model.num_condition_tokens).expand(len(labels), -1, -1)
        logits = model(codes[:, :-1], labels, mask=mask)[:, model.num_condition_tokens - 1 :]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), codes.reshape(-1)).item()

    width = aware.model.grid_size[1]
    for s in (2, 3):
        assert loss(aware, s) < loss(causal, s)
        assert loss(aware, s) - loss(aware, width) < loss(causal, s) - loss(causal, width)


@pytest.mark.slow
def test_t2i_model_reads_its_caption():
    """On held-out easy caption renders, the shipped t2i model's next-token loss is lowest with the
    image's own caption, higher with the null caption (CFG's), higher still with another image's
    (1.988 / 2.057 / 2.249 nats on 96 renders; the 4-layer model trained from scratch before it:
    1.952 / 1.997 / 2.105). The model of 2026-11-29, trained with the caption padding visible, was
    below its own null caption only when the padding was shown (2.10 against 2.01 as sampling
    shows it)."""
    import torch.nn.functional as F

    from visar.data.shapes import CLASS_RENDER_EASY, render_caption_sample
    from visar.train.loop import images_to_tensor

    pipe = visar.load("visar-tiny-t2i", device="cpu")
    model, encoder = pipe.model, pipe.text_encoder
    samples = [render_caption_sample(777_000 + i, **CLASS_RENDER_EASY) for i in range(48)]
    captions = [s.caption for s in samples]
    with torch.no_grad():
        codes = pipe.tokenizer.encode(images_to_tensor([s.image for s in samples])).reshape(len(samples), -1)

        def loss(prompts, null=False):
            embeds, mask = encoder.encode(prompts)
            embeds = model.null_condition(embeds) if null else embeds
            logits = model(codes[:, :-1], embeds, cond_mask=mask)[:, model.num_condition_tokens - 1 :]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), codes.reshape(-1)).item()

        right, null, other = loss(captions), loss(captions, null=True), loss(captions[1:] + captions[:1])
    assert right < null - 0.02 and null < other - 0.05, (right, null, other)


@pytest.mark.slow
def test_t2i_model_follows_its_prompts():
    """GenEval-style overall score of the shipped t2i model on 96 held-out images (seeds 300,000 and
    up; 16 per task): 31.7% on the 504 record images at its default cfg 1.5, 36.3% on 240 tuning
    images. The 4-layer model trained from scratch that it replaced scored 14.9% and 12.5% on
    120 held-out images; 20% is about 2.5 standard deviations under the measured score."""
    from visar.eval.shapes_eval import evaluate_shapes

    pipe = visar.load("visar-tiny-t2i", device="cpu")
    record = evaluate_shapes(pipe, n=96, method="ar", seed=300_000, batch_size=24, progress=False)
    assert record["overall"] >= 0.20, record


def check_recorded_recipes(
    name: str, family: str, recipe: dict, tokenizer_name: str, tokenizer_recipes: dict, forward_passes: int
):
    """A shipped model's config.json records its family, its recipe (model_args, defaults and the rest)
    and its tokenizer's recipe exactly as the code holds them (through JSON, as written), and the
    model generates two images in `forward_passes` passes."""
    config = json.loads((embedded_models()[name] / "config.json").read_text())
    recipe = json.loads(json.dumps(recipe))
    assert config["family"] == family and config["model_args"] == recipe.pop("model_args")
    assert config["defaults"] == recipe.pop("defaults")
    assert {k: v for k, v in config["recipe"].items() if k != "name"} == recipe
    assert config["tokenizer_recipe"]["name"] == tokenizer_name
    tokenizer_recipe = json.loads(json.dumps(tokenizer_recipes[tokenizer_name]))
    assert {k: v for k, v in config["tokenizer_recipe"].items() if k != "name"} == tokenizer_recipe
    pipe = visar.load(name, device="cpu")
    out = pipe.generate(class_labels=[0, 13], output_type="np")
    assert out.images.shape == (2, 64, 64, 3) and out.stats["forward_passes"] == forward_passes


def parameter_count(pipe) -> int:
    return sum(p.numel() for p in pipe.model.parameters())


# -- the next-scale (VAR) pair: drafter and refiner on one multi-scale VQVAE ----------------------------

VAR_PAIR = ["visar-tiny-var-c2i", "visar-tiny-var-c2i-refiner"]


@pytest.mark.parametrize("name", [*VAR_PAIR, "visar-tiny-var-c2i-refiner-s6"])
def test_var_pair_records_its_recipes_and_shares_the_multiscale_tokenizer(name):
    from visar.train.recipes import MSVQ_RECIPES, NEXT_SCALE_RECIPES

    check_recorded_recipes(name, "var", NEXT_SCALE_RECIPES[name], "visar-tiny-msvq", MSVQ_RECIPES, forward_passes=9)


def test_var_refiner_is_smaller_and_takes_over_from_the_drafter():
    drafter, refiner = (visar.load(name, device="cpu") for name in VAR_PAIR)
    assert parameter_count(refiner) * 4 <= parameter_count(drafter)
    out = drafter.generate(class_labels=[0, 13], method="code", refiner=refiner, draft_scales=6, output_type="np")
    assert out.images.shape == (2, 64, 64, 3) and out.stats["draft_forward_passes"] == 3


@pytest.mark.slow
def test_var_drafter_follows_its_class():
    """The shipped drafter draws the class's shape and colour far above chance (2.5%); see
    docs/MODELS.md for its figure on 500 images. 80 images, seeded: a pass or a failure repeats."""
    from visar.eval.shapes_eval import evaluate_shapes

    record = evaluate_shapes(visar.load("visar-tiny-var-c2i", device="cpu"), n=80, batch_size=40, progress=False)
    assert record["accuracy"] >= 0.60


MAR_PAIR = ["visar-tiny-mar-c2i", "visar-tiny-mar-c2i-draft"]


@pytest.mark.parametrize("name", MAR_PAIR)
def test_mar_pair_records_its_recipes_and_shares_the_kl_tokenizer(name):
    from visar.train.recipes import KL_RECIPES, MAR_RECIPES

    check_recorded_recipes(name, "mar", MAR_RECIPES[name], "visar-tiny-kl", KL_RECIPES, forward_passes=16)


@pytest.mark.slow  # cspd and mar-cache on the shipped pair at their default steps
def test_mar_draft_is_under_a_quarter_and_drafts_for_the_target():
    target, draft = (visar.load(name, device="cpu") for name in MAR_PAIR)
    assert parameter_count(draft) * 4 <= parameter_count(target)
    for method, options in {"cspd": {"draft": draft}, "mar-cache": {}}.items():
        out = target.generate(class_labels=[0, 13], method=method, output_type="np", **options)
        assert out.images.shape == (2, 64, 64, 3)
    assert out.stats["reused_token_fraction"] > 0


@pytest.mark.slow
def test_mar_target_follows_its_class():
    """The shipped MAR target draws the class's shape and colour well above chance (2.5%), though far
    from the 60% aimed at: 22.4% on 500 images (docs/MODELS.md), 21.25% on these 80 (seeded: a pass
    or a failure repeats). A model that ignored its class, or a broken sampler, scores near 2.5%."""
    from visar.eval.shapes_eval import evaluate_shapes

    record = evaluate_shapes(visar.load("visar-tiny-mar-c2i", device="cpu"), n=80, batch_size=40, progress=False)
    assert record["accuracy"] >= 0.15
