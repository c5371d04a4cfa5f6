"""KV cache, visibility masks, ragged batches and truncation of the LlamaGen model."""

import pytest
import torch

from visar.models.llamagen import LlamaGen, LlamaGenConfig


def tiny_model(model_type="c2i", **kw):
    torch.manual_seed(0)
    args = dict(
        dim=64,
        n_layer=2,
        n_head=4,
        vocab_size=32,
        num_classes=5,
        block_size=16,
        model_type=model_type,
        cls_token_num=1 if model_type == "c2i" else 6,
        caption_dim=8,
    )
    model = LlamaGen(LlamaGenConfig(**{**args, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return model


def test_incremental_cache_equals_full_forward():
    model = tiny_model()
    labels, tokens = torch.tensor([1, 3]), torch.randint(0, 32, (2, 16))
    full = model(tokens[:, :-1], labels)  # [2, 16, V]
    model.setup_cache(2)
    steps = [model(cond=labels, input_pos=torch.tensor([0]))]
    for i in range(15):
        steps.append(model(tokens[:, i : i + 1], input_pos=torch.tensor([1 + i])))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_window_forward_with_mask_equals_full_forward():
    """Several query positions in one call (a speculative window) give the full-forward logits."""
    model = tiny_model()
    labels, tokens = torch.tensor([1, 3]), torch.randint(0, 32, (2, 16))
    full = model(tokens[:, :-1], labels)
    model.setup_cache(2)
    first = model(tokens[:, :5], labels, input_pos=torch.arange(6))  # condition + 5 tokens
    window = model(tokens[:, 5:12], input_pos=torch.arange(6, 13))
    torch.testing.assert_close(torch.cat([first, window], 1), full[:, :13], atol=1e-5, rtol=0)


def test_arbitrary_mask_is_respected():
    """A query that may not see a key gives the same logits whatever that key holds."""
    model = tiny_model()
    labels = torch.tensor([2])
    tokens = torch.randint(0, 32, (1, 6))
    mask = torch.ones(1, 7, 7, dtype=torch.bool).tril()
    mask[0, 4:, 3] = False  # no later query sees position 3 (token 2), not even through other rows
    out_a = model(tokens, labels, mask=mask)
    tokens_b = tokens.clone()
    tokens_b[0, 2] = (tokens[0, 2] + 1) % 32
    out_b = model(tokens_b, labels, mask=mask)
    torch.testing.assert_close(out_a[0, 6], out_b[0, 6], atol=1e-6, rtol=0)
    torch.testing.assert_close(out_a[0, 4:], out_b[0, 4:], atol=1e-6, rtol=0)
    assert not torch.allclose(out_a[0, 3], out_b[0, 3])  # the row that does see it changes


def test_ragged_batch_and_truncation_equal_fresh_forward():
    """Per-sample positions, then truncation back to per-sample lengths, then a rewrite."""
    model = tiny_model()
    labels, tokens = torch.tensor([0, 4]), torch.randint(0, 32, (2, 16))
    model.setup_cache(2)
    model(tokens[:, :9], labels, input_pos=torch.arange(10))  # both samples: cond + 9 tokens
    lengths = torch.tensor([4, 8])  # keep cond + 3 tokens for sample 0, cond + 7 for sample 1
    model.truncate_cache(lengths)
    new = torch.randint(0, 32, (2, 3))
    pos = lengths[:, None] + torch.arange(3)  # ragged: [[4,5,6],[8,9,10]]
    out = model(new, input_pos=pos)
    model.clear_cache()
    for b, length in enumerate(lengths.tolist()):
        seq = torch.cat([tokens[b, : length - 1], new[b]])
        fresh = model(seq[None], labels[b : b + 1])  # no cache
        torch.testing.assert_close(out[b], fresh[0, length : length + 3], atol=1e-5, rtol=0)


def test_truncated_slots_are_hidden_until_written_again():
    """A mask that shows forgotten slots sees nothing there: the logits are those of a mask that hides them."""
    model = tiny_model()
    labels, tokens = torch.tensor([0, 1]), torch.randint(0, 32, (2, 8))
    model.setup_cache(2)
    model(tokens[:, :5], labels, input_pos=torch.arange(6))
    model.truncate_cache(torch.tensor([2, 6]))  # sample 0 keeps cond + 1 token
    query = tokens[:, 5:6]
    everything = torch.ones(2, 1, 17, dtype=torch.bool)  # shows every slot, forgotten ones included
    kept = torch.zeros(2, 1, 17, dtype=torch.bool)
    kept[0, 0, [0, 1, 6]], kept[1, 0, :7] = True, True  # what survives, and the query's own slot
    shown = model(query, input_pos=torch.tensor([[6], [6]]), mask=everything)
    hidden = model(query, input_pos=torch.tensor([[6], [6]]), mask=kept)
    torch.testing.assert_close(shown, hidden, atol=1e-6, rtol=0)
    # written again (the token it held), a slot is visible again: sample 1 never lost it
    model(tokens[:, 1:2], input_pos=torch.tensor([[2], [2]]))
    again = model(query, input_pos=torch.tensor([[6], [6]]), mask=everything)
    assert not torch.allclose(again[0], shown[0]) and torch.allclose(again[1], shown[1], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_run_and_agree(dtype):
    model = tiny_model()
    labels, tokens = torch.tensor([1]), torch.randint(0, 32, (1, 15))
    ref = model(tokens, labels)
    out = model.to(dtype)(tokens, labels)
    assert out.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)


def test_t2i_caption_mask_hides_padded_keys():
    model = tiny_model("t2i")
    captions = torch.randn(1, 6, 8)
    mask = torch.tensor([[False, False, True, True, True, True]])
    tokens = torch.randint(0, 32, (1, 4))
    out_a = model(tokens, captions, cond_mask=mask)
    captions_b = captions.clone()
    captions_b[0, :2] = torch.randn(2, 8)  # change only the padded positions
    out_b = model(tokens, captions_b, cond_mask=mask)
    torch.testing.assert_close(out_a[:, 5:], out_b[:, 5:], atol=1e-5, rtol=0)
    # and the cached path applies the same mask
    model.setup_cache(1, cond_mask=mask)
    cached = model(tokens, captions, input_pos=torch.arange(10))
    torch.testing.assert_close(cached, out_a, atol=1e-5, rtol=0)
