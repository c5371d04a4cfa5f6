"""The recipes that reproduce visar's embedded models: one base, and each model's recipe as overrides of it.

A recipe is a plain dict, seed included, recorded in each export's config.json (tokenizer.json for a
tokenizer), so that `visar train tokenizer --recipe visar-tiny-vq`, `visar train ar --recipe
visar-tiny-c2i` and the others reproduce the shipped weights (up to floating-point differences
between machines); tests/models/test_embedded_models.py checks every recipe against what its shipped model
recorded. A trainer reads only the fields a recipe has: a recipe without `ema_decay` keeps no weight
average, one without `init` starts from scratch. Why each model's settings are what they are:
docs/MODELS.md; how the loops use them: docs/TRAINING.md.
"""

from __future__ import annotations

from ..data.shapes import CLASS_RENDER_EASY
from ..errors import VisarError

# Every recipe: batches of 16, a 100-step warm-up of the learning rate, a checkpoint every 100 steps.
BASE = dict(batch_size=16, warmup=100, checkpoint_every=100)

# The tokenizers: fresh training renders every step (no dataset), 3,000 steps at lr 1e-3, held-out
# metrics on 512 renders.
TOKENIZER_BASE = dict(BASE, seed=0, steps=3000, lr=1e-3, eval_images=512)

# The generators: the default raster model's data (20,000 class renders of data seed 1, each one
# 28-px object on a calm background: visar/data/shapes.py), lr 3e-3 and a weight average (the lr
# ends at 10% of its peak: the average smooths the last steps' noise), and its sampling defaults
# (cfg 2: the best of the guidance sweep in docs/MODELS.md).
GENERATOR_BASE = dict(
    BASE,
    condition="class",
    data_seed=1,
    dataset_size=20_000,
    render=CLASS_RENDER_EASY,
    lr=3e-3,
    ema_decay=0.999,
    defaults=dict(guidance_scale=2.0, temperature=1.0, top_k=None, top_p=1.0),
)


def without(recipe: dict, *fields: str) -> dict:
    """A copy of `recipe` lacking `fields`: the override that removes a field instead of changing it."""
    return {key: value for key, value in recipe.items() if key not in fields}


def resolve_recipe(recipes: dict, name: str, overrides: dict) -> dict:
    """The named recipe with overrides (quick trials and tests); None values are ignored."""
    if name not in recipes:
        raise VisarError(f"unknown recipe {name!r}; known: {sorted(recipes)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(overrides) - set(recipes[name]))
    if unknown:
        raise VisarError(f"unknown recipe field(s) {unknown} for {name}")
    return {**recipes[name], **overrides}


# -- tokenizers (visar.train.raster, next_scale, continuous) --------------------------------------

TOKENIZER_RECIPES = {
    # LlamaGen's VQ: 512 codes of width 8 over a 16 x 16 grid for 64 px images.
    "visar-tiny-vq": dict(
        TOKENIZER_BASE,
        crop=32,  # train on random 32x32 crops: 4x cheaper, and the conv net is size-agnostic
        dead_code_every=100,
        vq_args=dict(
            codebook_size=512,
            codebook_embed_dim=8,
            encoder_ch_mult=[1, 1, 2],
            decoder_ch_mult=[1, 1, 2],
            z_channels=64,
            ch=32,
            num_res_blocks=1,
            codebook_show_usage=False,
        ),
    ),
}

# The scale schedule for 64 px images: 9 scales ending at the 16 x 16 map, 655 tokens per image.
SHAPES_SCALES = (1, 2, 3, 4, 6, 8, 10, 13, 16)

MSVQ_RECIPES = {
    # visar-tiny-vq's size class (ch 32, ch_mult 1-1-2, one res block; 64 px -> 16 x 16) with VAR's
    # quantizer: 512 codes of width 16 shared by the 9 scales, 4 Phi convs. Whole 64 px images
    # (the scales are fixed fractions of the last map, so crops would need another schedule).
    "visar-tiny-msvq": dict(
        TOKENIZER_BASE,
        dead_code_every=100,
        vq_args=dict(
            vocab_size=512,
            z_channels=16,
            ch=32,
            ch_mult=(1, 1, 2),
            num_res_blocks=1,
            beta=0.25,
            quant_resi=0.5,
            share_quant_resi=4,
            v_patch_nums=SHAPES_SCALES,
            using_sa=False,
            using_mid_sa=True,
        ),
    ),
}

KL_RECIPES = {
    # visar-tiny-vq's size class (ch 32, ch_mult 1-1-2, one res block; 64 px -> 16 x 16) with
    # continuous latents of 4 channels and MAR's VAE layout (no encoder attention at these sizes).
    "visar-tiny-kl": dict(
        TOKENIZER_BASE,
        crop=32,  # as visar-tiny-vq: 4x cheaper, and the conv net is size-agnostic
        kl_weight=1e-5,
        vq_args=dict(
            embed_dim=4,
            ch_mult=(1, 1, 2),
            ch=32,
            resolution=64,
            num_res_blocks=1,
            attn_resolutions=(),
            use_variational=True,
        ),
    ),
}

# -- raster generators (LlamaGen, visar.train.raster) ---------------------------------------------

# The default's recipe without zipar-aware training (plain causal); shipped as visar-tiny-c2i-causal.
# Small batches, many steps: at this size the step count, not the batch, limits how soon the class
# is used; 3 layers beat 4 at the same CPU time, and 6,400 compiled steps fit the hour with the
# tokenizing (the sweep and timings: docs/MODELS.md, tools/recipe_sweep.py).
C2I_CAUSAL = dict(
    GENERATOR_BASE,
    seed=1,
    steps=6400,
    model_args=dict(
        dim=128,
        n_layer=3,
        n_head=4,
        multiple_of=64,
        vocab_size=512,
        num_classes=40,
        block_size=256,
        cls_token_num=1,
        class_dropout_prob=0.1,
        token_dropout_p=0.0,
        resid_dropout_p=0.0,
        ffn_dropout_p=0.0,
    ),
)

AR_RECIPES = {
    "visar-tiny-c2i-causal": C2I_CAUSAL,
    # The default: the causal recipe with ZipAR-aware training (docs/MODELS.md). A quarter of the
    # sequences see only what zipar at lag 2 or 3 lets a position see, so next-set decoding asks the
    # model for conditionals it was trained on, at a price in plain AR quality; half the sequences
    # at lags 2-4 cost more (the comparison: docs/MODELS.md, "ZipAR-aware training").
    "visar-tiny-c2i": dict(C2I_CAUSAL, zipar_lags=(2, 3), zipar_fraction=0.25),
    # The draft learns the target's training set (the base's data seed and renders). It has no weight
    # average: it was trained before the recipes had one, and ships as trained.
    "visar-tiny-c2i-draft": dict(
        without(GENERATOR_BASE, "ema_decay"),
        seed=2,
        steps=5400,  # the schedule the target had when the draft was trained; a draft step costs under a third
        # 2 layers of width 64, 0.17 M parameters: under a quarter of the target's 0.78 M
        model_args=dict(C2I_CAUSAL["model_args"], dim=64, n_layer=2, n_head=2),
    ),
    # What the c2i recipe taught, for captions (docs/MODELS.md): batch 16 at lr 3e-3 with the weight
    # average, a compiled step, many steps, and the easy renders (a calm background; objects at the
    # largest size their count allows: 28 px alone, 24 for two, 20 for three, 18 for four).
    # It starts from the causal c2i model's transformer (`init`; the caption encoder and its
    # projection start fresh): a model that already draws each shape in each colour only has to learn
    # to read the caption (the pilot that compared it with a start from scratch: docs/MODELS.md).
    "visar-tiny-t2i": dict(
        GENERATOR_BASE,
        condition="caption",
        init="visar-tiny-c2i-causal",
        seed=3,
        data_seed=3,
        steps=10_000,
        dataset_size=30_000,
        # the init model's transformer, with 16 caption positions in place of the class token
        model_args=dict(
            without(C2I_CAUSAL["model_args"], "num_classes"), cls_token_num=16, caption_dim=64, model_type="t2i"
        ),
        text_encoder_args=dict(max_len=16, dim=64, n_layer=2, n_head=4),
        # the best of the held-out guidance and temperature sweep (tools/t2i_settings.py,
        # docs/t2i_settings.json, docs/MODELS.md)
        defaults=dict(GENERATOR_BASE["defaults"], guidance_scale=1.5),
    ),
}

# -- masked generators (MaskGIT, visar.train.masked) ----------------------------------------------

MASKED_RECIPES = {
    # The default raster model's data, size class and budget, for a bidirectional transformer: the
    # visar-tiny-c2i training set (data_seed 1, the easy class renders), 0.76 M parameters (0.78 M
    # raster), batch 16, lr 3e-3 with the weight average. A step costs about what a raster step
    # costs (257 positions, 3 layers of width 128; no causal mask), so it gets the raster budget of
    # 6,400 steps.
    "visar-tiny-maskgit-c2i": dict(
        GENERATOR_BASE,
        seed=4,
        steps=6400,
        model_args=dict(
            dim=128,
            n_layer=3,
            n_head=4,
            mlp_ratio=4.0,
            vocab_size=512,
            num_classes=40,
            grid_size=16,
            class_dropout_prob=0.1,
            dropout_p=0.0,
        ),
    ),
}

# -- next-scale generators (VAR, visar.train.next_scale) ------------------------------------------


def var_args(depth: int, dim: int, heads: int) -> dict:
    return dict(
        vocab_size=512,
        z_channels=16,
        num_classes=40,
        depth=depth,
        embed_dim=dim,
        num_heads=heads,
        mlp_ratio=4.0,
        attn_l2_norm=True,  # as every release
        patch_nums=SHAPES_SCALES,
    )


# The drafter (CoDe's large model): the raster default's size class (width 128, 3 layers, batch
# 16, lr 3e-3 with the weight average). A step holds 655 positions against the raster's 256, so
# the hour holds fewer steps: 3,000.
VAR_C2I = dict(
    GENERATOR_BASE,
    seed=5,
    steps=3000,
    class_dropout_prob=0.1,
    model_args=var_args(depth=3, dim=128, heads=4),
    # VAR's convention: guidance 1 + cfg at the last scale (ramped); the raster default's cfg 2
    # is guidance_scale 3 here. No top-k/top-p: the 512-code vocabulary is small. Temperature
    # 0.7: better than 1.0 on held-out images (docs/MODELS.md, docs/VAR.md).
    defaults=dict(GENERATOR_BASE["defaults"], guidance_scale=3.0, temperature=0.7),
)
# The refiner (CoDe's small model): half the width, 2 layers (about a fifth of the drafter's
# parameters), trained on the same tokens for the same 3,000 steps.
VAR_C2I_REFINER = dict(
    VAR_C2I,
    seed=6,
    model_args=var_args(depth=2, dim=64, heads=2),
    # alone, the refiner samples at temperature 1; inside `code` the drafter's call sets it
    defaults=dict(VAR_C2I["defaults"], temperature=1.0),
)
NEXT_SCALE_RECIPES = {
    "visar-tiny-var-c2i": VAR_C2I,
    "visar-tiny-var-c2i-refiner": VAR_C2I_REFINER,
    # CoDe's specialised fine-tuning: the refiner, trained on every scale, fine-tuned on the scales it
    # decodes after the drafter's 6 (sizes 10, 13, 16: 525 of the 655 tokens); the loss still sees
    # every earlier scale as context. No weight average (it lagged on the 3,000-step runs).
    "visar-tiny-var-c2i-refiner-s6": dict(
        VAR_C2I_REFINER,
        seed=7,
        init="visar-tiny-var-c2i-refiner",
        loss_from_scale=6,
        steps=3000,
        lr=1e-3,
        ema_decay=None,
    ),
}

# -- continuous-token generators (MAR, visar.train.continuous) ------------------------------------


def mar_args(width: int, depth: int, heads: int, head_depth: int, head_width: int) -> dict:
    """A MAR over the KL latents in 2 x 2 patches (8 x 8 tokens of 16 numbers, 8 px each)."""
    return dict(
        img_size=64,
        vae_stride=4,
        patch_size=2,
        encoder_embed_dim=width,
        encoder_depth=depth,
        encoder_num_heads=heads,
        decoder_embed_dim=width,
        decoder_depth=depth,
        decoder_num_heads=heads,
        vae_embed_dim=4,
        class_num=40,
        buffer_size=4,
        diffloss_d=head_depth,
        diffloss_w=head_width,
        num_sampling_steps="ddim25",  # 0, 40, ..., 960: see below
        diffusion_batch_mul=4,
        label_drop_prob=0.1,
        mask_ratio_min=0.7,
    )


# The head samples with upstream's "ddim25" respacing (guided-diffusion's space_timesteps: stride
# 40 from 0, so the first reverse step is t = 960), not "25" (even spacing, ending at t = 999). At
# t = 999 the cosine schedule's sqrt(1 / abar) is 2.0e4, and the first reverse step scales the
# head's eps error by about 1,300 (2.0e4 x sqrt(abar) of the next step): a head this small, far
# less precise than upstream's, draws noise images from there, and shapes from t = 960
# (sqrt(1 / abar) 17; the run: docs/MODELS.md). Sampling starts from N(0, I), which q(x_960)
# is up to a signal of sqrt(abar) = 0.06.
#
# The target: width 128, 2 + 2 blocks (the raster default's size class), a 3-block head of width
# 128. The head is kept small, as upstream's are next to their trunks: per image it runs
# 25 steps x 2 (guidance) on every token, so a wide head takes most of the sampling time
# (docs/MODELS.md), which no trunk-side method can touch.
MAR_C2I = dict(
    GENERATOR_BASE,
    seed=8,
    steps=18_000,
    lr=2e-3,
    model_args=mar_args(width=128, depth=2, heads=4, head_depth=3, head_width=128),
    defaults=dict(GENERATOR_BASE["defaults"], guidance_scale=3.0),
)
MAR_RECIPES = {
    "visar-tiny-mar-c2i": MAR_C2I,
    # The draft for cspd: half the width, one block each side, a 2-block head of width 96 (under a
    # quarter of the target's parameters); same latents, classes and sampling defaults.
    "visar-tiny-mar-c2i-draft": dict(
        MAR_C2I,
        seed=9,
        steps=4000,
        model_args=mar_args(width=64, depth=1, heads=2, head_depth=2, head_width=96),
        # cspd accepts a drafted token by how close the draft's reverse steps are to the target's: the
        # draft learns the data and, with weight 1, the KL of its sampler steps to the target's
        # (distillation). Plain MSE to the target's head outputs at uniform timesteps left the
        # low-noise steps apart, and exact mode accepted nothing.
        distill_from="visar-tiny-mar-c2i",
        distill_weight=1.0,
    ),
}
