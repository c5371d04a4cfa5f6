"""VAR: strict loading of the official-code fixtures and exact reproduction of their outputs; the next-scale
methods (var, code, var-prune) against plain VAR; and one clear error for each bad input."""

import json

import pytest
import torch
from conftest import fixtures_dir
from laws import tiny_llamagen
from safetensors.torch import load_file

import visar
from visar.accel import methods_for
from visar.accel.next_scale.methods import ramped_guidance
from visar.errors import CheckpointMismatchError, VisarError
from visar.families import FAMILIES
from visar.families import var as var_family
from visar.loading import seeded_init
from visar.models.var import VAR, VARConfig
from visar.tokenizers.msvq import MSVQConfig, MultiScaleVQVAE, phi_index_per_scale

# -- the official fixtures ----------------------------------------------------------------------------


def fixture(name):
    folder = fixtures_dir("var")
    meta = json.loads((folder / f"tiny_{name}.json").read_text())
    return folder, meta, load_file(str(folder / f"tiny_{name}_io.safetensors"))


def vq_args():
    _, meta, _ = fixture("vqvae")
    return {**meta["constructor_kwargs"], "ch_mult": meta["encoder_decoder_ch_mult"]}


def fixture_pipe(name):
    folder, meta, _ = fixture(name)
    # Upstream's constructor arguments alone: the vocabulary and latent width come from the VQVAE's (vq_args).
    return visar.load(
        "var",
        checkpoint=folder / f"tiny_{name}.pt",
        model_args=meta["constructor_kwargs"],
        vq_checkpoint=folder / "tiny_vqvae.pt",
        vq_args=vq_args(),
        device="cpu",
    )


@pytest.fixture(scope="module", params=["var", "var_saln"])
def var_fixture(request):
    return request.param, fixture_pipe(request.param)


def scale_maps(io, prefix, sides=(1, 2, 4)):
    return [io[f"{prefix}{k}"].reshape(-1, side, side) for k, side in enumerate(sides)]


def test_vqvae_encode_decode_and_fhat():
    _, _, io = fixture("vqvae")
    pipe = fixture_pipe("var")
    vq = pipe.tokenizer
    assert vq.quantize.quant_resi.index == [0, 2, 3]  # the fixture's diagnostics: Phi per scale
    with torch.no_grad():
        torch.testing.assert_close(vq.quant_conv(vq.encoder(io["image"])), io["encoder_f"], atol=1e-4, rtol=1e-4)
        for k, tokens in enumerate(vq.encode(io["image"])):
            assert torch.equal(tokens.reshape(2, -1), io[f"encode_idx_scale{k}"])
        tokens = scale_maps(io, "decode_idx_scale")
        f_hats = vq.accumulate(tokens)
        torch.testing.assert_close(f_hats[-1], io["decode_fhat"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(vq.decode(tokens), io["decoded_image"], atol=1e-4, rtol=1e-4)
        for k, f_hat in enumerate(f_hats):
            torch.testing.assert_close(
                vq.decode_latent(f_hat), io[f"decoded_image_upto_scale{k}"], atol=1e-4, rtol=1e-4
            )


def test_release_phi_schedule_resolves_ties_as_upstream():
    assert phi_index_per_scale(4, 10) == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert phi_index_per_scale(4, 3) == [0, 2, 3]


def test_teacher_forced_logits(var_fixture):
    name, pipe = var_fixture
    _, _, io = fixture(name)
    inputs = pipe.tokenizer.teacher_forcing_inputs(scale_maps(io, "gt_idx_scale"))
    torch.testing.assert_close(inputs, io["x_BLCv_wo_first_l"], atol=1e-5, rtol=0)
    with torch.no_grad():
        logits = pipe.model(io["labels"], io["x_BLCv_wo_first_l"])
        null = pipe.model(pipe.model.null_condition(io["labels"]), io["x_BLCv_wo_first_l"])
    torch.testing.assert_close(logits, io["logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(null, io["logits_null_label"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg", [0.0, 1.5, 4.0])
def test_greedy_inference_and_decode(var_fixture, cfg):
    """Upstream's cfg c is guidance_scale 1 + c (a weight of 1 + c on cond at the last scale)."""
    name, pipe = var_fixture
    _, meta, io = fixture(name)
    labels = meta["autoregressive_infer_cfg_kwargs"]["label_B"]
    out = pipe.generate(class_labels=labels, guidance_scale=1 + cfg, top_k=1, output_type="pt")
    assert [t.shape for t in out.tokens] == [(2, 1, 1), (2, 2, 2), (2, 4, 4)]
    for k, tokens in enumerate(out.tokens):
        assert torch.equal(tokens.reshape(2, -1), io[f"infer_idx_cfg{cfg:g}_scale{k}"])
    torch.testing.assert_close(out.images, io[f"infer_img_cfg{cfg:g}"], atol=1e-4, rtol=1e-4)
    assert out.stats["method"] == "var" and out.stats["forward_passes"] == 3 and out.stats["lossless"]


def test_ramped_guidance_is_vars_convention():
    assert ramped_guidance(2.5, 0, 10) == 1.0  # no guidance at the first scale
    assert ramped_guidance(2.5, 9, 10) == 2.5  # "cfg 1.5": a weight of 2.5 on cond at the last
    assert ramped_guidance(1.0, 5, 10) == 1.0


# -- the real releases' layouts -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, manifest",
    [
        ("var-d16", "var_d16"),
        ("var-d20", "var_d20"),
        ("var-d24", "var_d24"),
        ("var-d30", "var_d30"),
        ("var-d36", "var_d36-s"),
    ],
)
def test_presets_match_the_release_manifests(preset, manifest):
    expected = json.loads((fixtures_dir("var") / f"manifest_{manifest}.json").read_text())
    config = VARConfig.from_dict(visar.registry.OFFICIAL_PRESETS[preset].model_args)
    with torch.device("meta"):
        model = VAR(config)
    found = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert found == expected["state_dict"]
    assert sum(p.numel() for p in model.parameters()) == expected["num_parameters"]


def test_vqvae_preset_matches_the_release_manifest():
    expected = json.loads((fixtures_dir("var") / "manifest_vqvae_ch160v4096z32.json").read_text())
    with torch.device("meta"):
        vq = MultiScaleVQVAE(MSVQConfig())
    assert {k: list(v.shape) for k, v in vq.state_dict().items()} == expected["state_dict"]
    assert sum(p.numel() for p in vq.parameters()) == expected["num_parameters"]


def test_a_checkpoint_of_another_depth_names_the_preset_that_fits(monkeypatch, tmp_path):
    with torch.device("meta"):
        d16 = VAR(var_family.release_config("var-d16")).state_dict()
    monkeypatch.setattr(var_family, "read_state_dict", lambda path: d16)
    with pytest.raises(CheckpointMismatchError, match="the preset that fits is 'var-d16'"):
        visar.load("var-d20", checkpoint=tmp_path / "var_d16.pth", device="cpu")


def test_wrong_model_args_fail_strictly():
    folder, meta, _ = fixture("var")
    with pytest.raises(CheckpointMismatchError, match="no known preset fits"):
        visar.load(
            "var",
            checkpoint=folder / "tiny_var.pt",
            model_args={**meta["constructor_kwargs"], "depth": 3, "vocab_size": 64, "z_channels": 8},
            device="cpu",
        )


# -- the methods on tiny random models ----------------------------------------------------------------


def tiny_var(seed=0, **overrides) -> VAR:
    model = VAR(VARConfig.from_dict({**FAMILIES["var"].tiny_model_args, **overrides}))
    seeded_init(model, seed, std=0.3)
    return model.eval()


def tiny_vqvae(seed=0, **overrides) -> MultiScaleVQVAE:
    torch.manual_seed(seed)
    return MultiScaleVQVAE(MSVQConfig.from_dict({**FAMILIES["var"].tiny_tokenizer_args, **overrides})).eval()


@pytest.fixture(scope="module")
def pair():
    """A tiny drafter pipeline and a differently seeded refiner of the same family and VQVAE."""
    vq = tiny_vqvae()
    drafter = visar.Pipeline(tiny_var(0), vq, name="drafter", defaults={"guidance_scale": 2.0})
    refiner = visar.Pipeline(tiny_var(1), vq, name="refiner", defaults={"guidance_scale": 2.0})
    return drafter, refiner


def generate(pipe, **kwargs):
    return pipe.generate(class_labels=[0, 1, 2, 3], seed=11, output_type="tokens", **kwargs).tokens


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_code_with_every_scale_drafted_is_the_drafter_alone(pair):
    drafter, refiner = pair
    scales = len(drafter.model.scale_sizes)
    assert same(generate(drafter, method="code", refiner=refiner, draft_scales=scales), generate(drafter))
    out = drafter.generate(class_labels=[0], method="code", refiner=refiner, draft_scales=scales, output_type="tokens")
    assert out.stats["lossless"] and out.stats["draft_forward_passes"] == 0


def test_code_with_no_scale_drafted_is_the_refiner_alone(pair):
    drafter, refiner = pair
    assert same(generate(drafter, method="code", refiner=refiner, draft_scales=0), generate(refiner))


def test_code_hands_over_midway(pair):
    drafter, refiner = pair
    tokens = generate(drafter, method="code", refiner=refiner, draft_scales=2)
    alone = generate(drafter)
    assert same(tokens[:2], alone[:2])  # the drafted scales are the drafter's, draw for draw
    assert not same(tokens[2:], alone[2:])  # the refiner's are its own
    out = drafter.generate(class_labels=[0, 1], method="code", refiner=refiner, draft_scales=2, output_type="pil")
    assert out.stats["forward_passes"] == 4 and out.stats["draft_forward_passes"] == 2
    assert len(out.images) == 2 and out.images[0].size == (8, 8)


def test_code_samples_the_refiner_at_its_own_temperature(pair):
    drafter, refiner = pair
    base = generate(drafter, method="code", refiner=refiner, draft_scales=2)
    assert same(generate(drafter, method="code", refiner=refiner, draft_scales=2, refiner_temperature=1.0), base)
    cooled = generate(drafter, method="code", refiner=refiner, draft_scales=2, refiner_temperature=0.05)
    assert same(cooled[:2], base[:2]) and not same(cooled[2:], base[2:])  # only the refiner's scales move
    with pytest.raises(VisarError, match="temperature must be a number from"):
        generate(drafter, method="code", refiner=refiner, refiner_temperature=0)
    # under the call's entropy temperature the refiner's own temperature takes its place there
    hot = generate(drafter, method="code", refiner=refiner, draft_scales=2, entropy_temperature=1.4)
    hot_cooled = generate(
        drafter, method="code", refiner=refiner, draft_scales=2, entropy_temperature=1.4, refiner_temperature=0.05
    )
    assert not same(hot[:2], base[:2]) and same(hot_cooled[:2], hot[:2]) and not same(hot_cooled[2:], hot[2:])


@pytest.mark.parametrize("drafted", [1, 2, 3])
def test_refiner_prefill_cache_equals_a_scale_by_scale_run(drafted):
    """One block-causal pass over scales 0 .. N gives the cache and scale-N logits of N + 1 cached passes."""
    model, vq = tiny_var(1), tiny_vqvae()
    cond = torch.tensor([0, 3, 4])  # 4 is the null class
    tokens = [torch.randint(0, 16, (3, side, side)) for side in model.scale_sizes]
    inputs = vq.teacher_forcing_inputs(tokens)  # scales 1 .. S - 1
    sides = [side * side for side in model.scale_sizes]
    with torch.no_grad():
        model.setup_cache(3)
        logits = model(cond)
        for k in range(1, drafted + 1):
            begin = sum(sides[1:k])
            logits = model(cond, inputs[:, begin : begin + sides[k]], first_scale=k)
        stepwise = [(b.attn.cache.k.clone(), b.attn.cache.v.clone(), b.attn.cache.length) for b in model.blocks]
        model.setup_cache(3)
        prefill_logits = model(cond, inputs[:, : sum(sides[1 : drafted + 1])])
        prefill = [(b.attn.cache.k.clone(), b.attn.cache.v.clone(), b.attn.cache.length) for b in model.blocks]
        # last_scale_only (what CoDe's refiner calls): the last block skips the earlier scales' outputs
        model.setup_cache(3)
        last_only = model(cond, inputs[:, : sum(sides[1 : drafted + 1])], last_scale_only=True)
        last_only_cache = [(b.attn.cache.k, b.attn.cache.v, b.attn.cache.length) for b in model.blocks]
        model.clear_cache()
    torch.testing.assert_close(prefill_logits[:, -sides[drafted] :], logits, atol=1e-5, rtol=1e-5)
    assert last_only.shape == logits.shape
    torch.testing.assert_close(last_only, logits, atol=1e-5, rtol=1e-5)
    for (k1, v1, n1), (k2, v2, n2), (k3, v3, n3) in zip(stepwise, prefill, last_only_cache, strict=True):
        assert n1 == n2 == n3 == sum(sides[: drafted + 1])
        for cached in (k2[:, :, :n2], k3[:, :, :n3]):
            torch.testing.assert_close(k1[:, :, :n1], cached, atol=1e-5, rtol=1e-5)
        for cached in (v2[:, :, :n2], v3[:, :, :n3]):
            torch.testing.assert_close(v1[:, :, :n1], cached, atol=1e-5, rtol=1e-5)


def test_teacher_forcing_equals_the_cached_scale_by_scale_logits():
    model, vq = tiny_var(0), tiny_vqvae()
    cond = torch.tensor([1, 2])
    tokens = [torch.randint(0, 16, (2, side, side)) for side in model.scale_sizes]
    inputs = vq.teacher_forcing_inputs(tokens)
    with torch.no_grad():
        full = model(cond, inputs)
        model.setup_cache(2)
        parts, begin = [model(cond)], 0
        for k, side in enumerate(model.scale_sizes[1:], start=1):
            parts.append(model(cond, inputs[:, begin : begin + side * side], first_scale=k))
            begin += side * side
        model.clear_cache()
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_prune_with_every_token_kept_is_plain_var(pair):
    drafter, _ = pair
    assert same(generate(drafter, method="var-prune", keep_fraction=1.0, prune_scales=3), generate(drafter))
    out = drafter.generate(class_labels=[0], method="var-prune", keep_fraction=1.0, output_type="tokens")
    assert out.stats["lossless"] is True


def test_prune_changes_only_the_pruned_scales(pair):
    drafter, _ = pair
    pruned = generate(drafter, method="var-prune", keep_fraction=0.25, prune_scales=[3], top_k=1)
    plain = generate(drafter, top_k=1)
    assert same(pruned[:3], plain[:3]) and not torch.equal(pruned[3], plain[3])
    out = drafter.generate(class_labels=[0], method="var-prune", keep_fraction=0.25, output_type="tokens")
    assert out.stats["lossless"] is False and out.stats["pruned_scales"] == [2, 3]


@pytest.mark.parametrize("drafted", [1, 2])
def test_code_with_pruning_and_the_same_model_twice_is_var_prune(pair, drafted):
    """The refiner's prefill records its last scale as a one-scale call would, so the next scale prunes
    alike: CoDe with the drafter as its own refiner equals var-prune (scale N is never pruned)."""
    drafter, _ = pair
    pruned = [drafted + 1]  # the first scale after the prefill
    combined = generate(drafter, method="code", refiner=drafter, draft_scales=drafted, keep_fraction=0.25,
                        prune_scales=pruned, top_k=1)  # fmt: skip
    alone = generate(drafter, method="var-prune", keep_fraction=0.25, prune_scales=pruned, top_k=1)
    assert same(combined, alone)
    assert not same(alone, generate(drafter, top_k=1))  # the pruning changes tokens: the comparison can fail


def test_code_with_pruning_reports_the_pruned_scales_and_is_lossy(pair):
    drafter, refiner = pair
    scales = len(drafter.model.scale_sizes)
    out = drafter.generate(class_labels=[0], method="code", refiner=refiner, draft_scales=2, keep_fraction=0.5,
                           output_type="tokens")  # fmt: skip
    assert out.stats["pruned_scales"] == [3] and out.stats["lossless"] is False  # scale 2 is the prefill's
    out = drafter.generate(class_labels=[0], method="code", refiner=refiner, draft_scales=scales, keep_fraction=0.5,
                           output_type="tokens")  # fmt: skip
    assert out.stats["pruned_scales"] == [2, 3] and out.stats["lossless"] is False
    with pytest.raises(VisarError, match="keep_fraction must be in"):
        generate(drafter, method="code", refiner=refiner, keep_fraction=0)


def test_layer_tokens_count_what_went_through_each_models_layers(pair):
    drafter, refiner = pair  # scales 1, 2, 3, 4: 1 + 4 + 9 + 16 = 30 inputs

    def stats(method, **options):
        return drafter.generate(class_labels=[0, 1], method=method, output_type="tokens", **options).stats

    assert (stats("var")["layer_tokens"], stats("var")["draft_layer_tokens"]) == (30, 0)
    assert stats("var-prune", keep_fraction=0.25)["layer_tokens"] == 1 + 4 + 3 + 4  # ceil(9 / 4), 16 / 4
    code = stats("code", refiner=refiner, draft_scales=2)
    assert (code["layer_tokens"], code["draft_layer_tokens"]) == (1 + 4, 1 + 4 + 9 + 16)  # the prefill re-reads 0, 1


def test_methods_list_the_next_scale_kind():
    from visar.accel import METHODS

    assert {METHODS[m].model_kind for m in ("var", "code", "var-prune")} == {"next-scale"}
    assert METHODS["var"].lossless and not METHODS["code"].lossless
    assert METHODS["var-prune"].lossless_label == "lossy (exact when keep_fraction=1)"
    assert METHODS["code"].needs_draft and METHODS["code"].draft_option == "refiner"
    code_options = ["refiner", "draft_scales", "keep_fraction", "prune_scales", "refiner_temperature"]
    assert METHODS["code"].options == code_options


# -- bad input: one clear error each ------------------------------------------------------------------


@pytest.mark.parametrize("drafted", [-1, 5, 2.5])
def test_code_refuses_a_split_outside_the_scales(pair, drafted):
    drafter, refiner = pair
    with pytest.raises(VisarError, match=r"draft_scales must be an integer in 0\.\.4"):
        generate(drafter, method="code", refiner=refiner, draft_scales=drafted)


def test_code_refuses_a_refiner_with_another_scale_schedule(pair):
    drafter, _ = pair
    other = tiny_var(1, patch_nums=(1, 2, 4))
    with pytest.raises(VisarError, match="scales .* differ"):
        generate(drafter, method="code", refiner=other)


def test_code_refuses_a_refiner_with_another_tokenizer(pair):
    drafter, refiner = pair
    other_vq = visar.Pipeline(refiner.model, tiny_vqvae(seed=5), name="other-vq")
    with pytest.raises(VisarError, match="tokenizer differs"):
        generate(drafter, method="code", refiner=other_vq)
    with pytest.raises(VisarError, match="different tokenizers"):
        generate(drafter, method="code", refiner=tiny_var(1, vocab_size=32))


def test_code_refuses_a_raster_refiner(pair):
    drafter, _ = pair
    with pytest.raises(VisarError, match="must be a next-scale model"):
        generate(drafter, method="code", refiner=tiny_llamagen(vocab=16, block_size=16))


def test_prune_refuses_bad_options(pair):
    drafter, _ = pair
    with pytest.raises(VisarError, match="keep_fraction must be in"):
        generate(drafter, method="var-prune", keep_fraction=0)
    with pytest.raises(VisarError, match="scale indices must be in 1..3"):
        generate(drafter, method="var-prune", prune_scales=[0, 3])


def test_next_scale_decoding_needs_the_vqvae(pair):
    drafter, _ = pair
    bare = visar.Pipeline(drafter.model, None, name="no-vq")
    with pytest.raises(VisarError, match="vq_checkpoint="):
        bare.generate(class_labels=[0], output_type="tokens")


def test_a_vqvae_of_another_schedule_is_refused(pair):
    drafter, _ = pair
    pipe = visar.Pipeline(drafter.model, tiny_vqvae(v_patch_nums=(1, 2, 4)), name="mismatch")
    with pytest.raises(VisarError, match="VQVAE's scales"):
        pipe.generate(class_labels=[0], output_type="tokens")


def test_presets_carry_vars_sampling_defaults():
    presets = visar.registry.OFFICIAL_PRESETS
    assert {"var-d16", "var-d20", "var-d24", "var-d30", "var-d36"} <= set(presets)
    assert presets["var-d30"].defaults == {"guidance_scale": 2.5, "temperature": 1.0, "top_k": 900, "top_p": 0.96}
    assert presets["var-d36"].model_args["shared_aln"] and presets["var-d36"].tokenizer_args["v_patch_nums"][-1] == 32


def test_raster_only_helpers_refuse_a_next_scale_model(pair):
    drafter, _ = pair
    with pytest.raises(VisarError, match="Pipeline.logits is for raster models"):
        drafter.logits(torch.zeros(1, 30, dtype=torch.long), class_labels=[0])


def test_a_pruned_scale_sends_only_the_kept_tokens_through_the_layers():
    model, vq = tiny_var(0), tiny_vqvae()
    cond = torch.tensor([1, 2])
    tokens = [torch.randint(0, 16, (2, side, side)) for side in model.scale_sizes]
    inputs = vq.teacher_forcing_inputs(tokens)
    with torch.no_grad():
        model.setup_cache(2, pruning=True)
        model(cond)
        model(cond, inputs[:, :4], first_scale=1)
        model(cond, inputs[:, 4:13], first_scale=2)
        logits = model(cond, inputs[:, 13:], first_scale=3, keep_fraction=0.25)  # 4 of 16 tokens
        lengths = {block.attn.cache.length for block in model.blocks}
        model.setup_cache(2)  # without pruning=True nothing is kept to reuse
        model(cond)
        with pytest.raises(VisarError, match="pruning=True"):
            model(cond, inputs[:, :4], first_scale=1, keep_fraction=0.5)
        model.clear_cache()
    assert logits.shape == (2, 16, 16) and lengths == {1 + 4 + 9 + 4}


def test_bench_measures_next_scale_methods_against_var(pair):
    from visar.eval.bench import bench

    drafter, refiner = pair
    options = {"code": {"refiner": refiner, "draft_scales": 2}, "var-prune": {"keep_fraction": 0.25}}
    report = bench(drafter, ["code", "var-prune"], n=3, batch_size=2, method_options=options, progress=False)
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["var", "code", "var-prune"] and rows["var"]["latency_ratio_vs_ar"] == 1.0
    assert all(r["forward_passes"] == 4 and r["step_compression"] == 30 / 4 for r in rows.values())
    assert (rows["code"]["layer_tokens"], rows["code"]["draft_layer_tokens"]) == (5, 30)
    assert rows["var-prune"]["layer_tokens"] == 12 and not rows["var-prune"]["lossless"]


@pytest.mark.one_thread  # tokens of a batch against each image alone
def test_batch_generation_decodes_each_next_scale_image_alone(pair, tmp_path):
    """`visar generate` / eval fid write one PNG per image: a next-scale batch's tokens (a list of maps
    per scale) are split per image, and each PNG is the image `generate` decodes for that seed."""
    import numpy as np
    from PIL import Image

    from visar.eval.samples import SampleJob, generate_missing

    drafter, refiner = pair
    jobs = [SampleJob(tmp_path / f"{i}.png", condition=c, seed=i) for i, c in enumerate([0, 3, 1])]
    options = dict(refiner=refiner, draft_scales=2)
    stats = generate_missing(drafter, jobs, method="code", batch_size=2, progress=False, **options)
    assert stats["generated"] == 3
    for job in jobs:
        expected = drafter.generate(class_labels=[job.condition], seed=job.seed, method="code", refiner=refiner,
                                    draft_scales=2, output_type="np").images[0]  # fmt: skip
        assert np.array_equal(np.asarray(Image.open(job.path).convert("RGB")), expected)


def test_demo_compares_a_next_scale_model_and_draws_its_scales():
    """The demo's comparison on the shipped VAR drafter: the reference side is `var`, the refiner is
    offered by name, and the heatmap shows one map per scale (one pass each)."""
    from visar.apps.demo import ModelCache, commit_heatmap, compare, default_options, tokens_per_pass

    cache = ModelCache(device="cpu")
    pipe = cache.get("visar-tiny-var-c2i")
    assert methods_for(pipe.model) == ["var", "code", "var-prune"]
    texts = default_options("code", "visar-tiny-var-c2i")
    assert texts["refiner"] == "visar-tiny-var-c2i-refiner"
    fields = [texts.get(name, "") for name in ("refiner", "draft_scales", "keep_fraction", "prune_scales")]
    *_, summary, heatmap, commit_pass, stats = compare(
        cache, "visar-tiny-var-c2i", "red circle", "", "", "code", 0, 3.0, 1.0, 0, 1.0, fields + [""] * 7
    )
    assert stats["ar"]["method"] == "var" and stats["method"]["forward_passes"] == 9
    assert "| var (the reference) | code |" in summary
    per_pass = tokens_per_pass(commit_pass)  # what the page's bar plot shows
    assert list(per_pass["tokens committed"]) == [side * side for side in pipe.model.scale_sizes]
    # the scales in lines (about square, over the colour bar): the last one, 16 cells of 16 px, is a line's height
    assert heatmap.size[1] >= 16 * 16 + 34 and 0.5 <= heatmap.size[0] / (heatmap.size[1] - 34) <= 2
    picture = commit_heatmap([torch.full((s, s), k + 1) for k, s in enumerate((1, 2, 3))])
    assert picture.size[0] < picture.size[1] - 34  # three small maps: one to a line, stacked


def test_vocabulary_and_latent_width_come_from_the_vqvae_arguments():
    folder, meta, _ = fixture("var")
    pipe = fixture_pipe("var")
    assert (pipe.model.config.vocab_size, pipe.model.config.z_channels) == (64, 8)
    agreeing = {**meta["constructor_kwargs"], "vocab_size": 64}
    load = dict(
        checkpoint=folder / "tiny_var.pt", vq_checkpoint=folder / "tiny_vqvae.pt", vq_args=vq_args(), device="cpu"
    )
    assert visar.load("var", model_args=agreeing, **load).model.config.vocab_size == 64
    with pytest.raises(
        VisarError, match=r"model_args vocab_size=4096 disagrees with the VQVAE's vocab_size=64 \(vq_args\)"
    ):
        visar.load("var", model_args={**agreeing, "vocab_size": 4096}, **load)
