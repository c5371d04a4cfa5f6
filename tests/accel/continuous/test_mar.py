"""MAR: the diffusion head along a chain equals its calls one by one, mar-cache's no-reuse equality with
plain MAR, and one clear error per bad input (cspd's drafts included). CSpD's exactness:
tests/accel/continuous/test_cspd.py."""

import warnings

import pytest
import torch
from laws import tiny_mar

import visar
from visar.errors import VisarError
from visar.families import FAMILIES


def test_the_head_along_a_chain_equals_its_calls_one_by_one():
    """diffusion_chain computes the timestep and condition embeddings once; its outputs are the head's."""
    model = tiny_mar(0, num_sampling_steps="ddim4")
    timesteps = torch.tensor(model.diffusion_schedule().timestep_map)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, model.diffloss.net.cond_embed.in_features, generator=gen)
    with torch.no_grad():
        head = model.diffusion_chain(z, timesteps)
        for i in range(len(timesteps)):
            x = torch.randn(5, model.token_dim, generator=gen)
            one_by_one = model.diffusion_head(x, timesteps[i].expand(5), z)
            torch.testing.assert_close(head(x, i), one_by_one, rtol=1e-5, atol=1e-6)
            other = timesteps[(i + 1) % len(timesteps)].expand(5)  # the step matters: the check can fail
            assert not torch.allclose(head(x, i), model.diffusion_head(x, other, z))


def test_mar_cache_reusing_nothing_is_plain_mar():
    pipe = visar.Pipeline(tiny_mar(0), None, name="tiny-mar", defaults={"guidance_scale": 2.0})
    run = dict(class_labels=[0, 3], num_iter=4, output_type="tokens", seed=3)
    plain = pipe.generate(method="mar", **run).tokens
    same = pipe.generate(method="mar-cache", token_threshold=0.0, null_interval=1, **run)
    assert torch.equal(plain, same.tokens) and same.stats["lossless"]
    lossy = pipe.generate(method="mar-cache", token_threshold=0.5, null_interval=2, **run)
    assert not lossy.stats["lossless"] and lossy.stats["reused_token_fraction"] > 0


def test_bad_inputs_give_one_clear_error(tmp_path):
    target = tiny_mar(0)
    pipe = visar.Pipeline(target, None, name="tiny-mar")
    wide = tiny_mar(1, vae_embed_dim=3)
    with pytest.raises(VisarError, match="token width differ"):
        pipe.generate(class_labels=[0], method="cspd", draft=wide, output_type="tokens")
    other_grid = tiny_mar(1, img_size=12)
    with pytest.raises(VisarError, match="order"):
        pipe.generate(class_labels=[0], method="cspd", draft=other_grid, output_type="tokens")
    with pytest.raises(VisarError, match="decodes raster models"):
        pipe.generate(class_labels=[0], method="sjd", output_type="tokens")
    for method, options in (("mar", {}), ("mar-cache", {}), ("cspd", {"draft": target})):  # no logits to temper
        with pytest.raises(VisarError, match="entropy_temperature do not apply"):
            pipe.generate(class_labels=[0], method=method, entropy_temperature=1.4, output_type="tokens", **options)
    family = FAMILIES["mar"]
    torch.manual_seed(0)
    vae_a = family.build_tokenizer(family.tiny_tokenizer_args)
    vae_b = family.build_tokenizer(family.tiny_tokenizer_args)  # other weights: other images
    with_vae = visar.Pipeline(target, vae_a, name="tiny-mar")
    draft_pipe = visar.Pipeline(tiny_mar(1), vae_b, name="tiny-mar-draft")
    with pytest.raises(VisarError, match="tokenizer differs"):
        with_vae.generate(class_labels=[0], method="cspd", draft=draft_pipe, output_type="tokens")
    vae = family.build_tokenizer({**family.tiny_tokenizer_args, "embed_dim": 3})
    with pytest.raises(VisarError, match="VAE does not fit"):
        family.check_tokenizer(target, vae)
    # an official file without model_ema loads `model`, and says so
    path = tmp_path / "no_ema.pt"
    torch.save({"model": target.state_dict()}, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = visar.load("mar", checkpoint=path, model_args=family.tiny_model_args, device="cpu")
    assert any("no 'model_ema'" in str(w.message) for w in caught)
    assert torch.equal(loaded.model.fake_latent, target.fake_latent)
