"""LeanLlamaDecoder (models/lean_llama.py) equals transformers' LlamaModel with the same weights: full
sequences with left padding, incremental decoding over a growing cache, tree masks; bad masks are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaModel

from mmspec.models.lean_llama import LeanLlamaDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["autograd", "no_grad"])
def grad_mode(request):
    """Every equality check runs on the autograd path and on the no-grad fast path (fused projections)."""
    context = torch.enable_grad() if request.param == "autograd" else torch.no_grad()
    with context:
        yield request.param


def _pair(kv_heads: int = 2, seed: int = 0, bias: bool = False):
    config = LlamaConfig(attention_bias=bias, mlp_bias=bias, vocab_size=1, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, rope_theta=500.0, rms_norm_eps=1e-6, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    reference = LlamaModel(config).double().eval()
    reference.embed_tokens = None
    lean = LeanLlamaDecoder(config).double().eval()
    missing, unexpected = lean.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and not unexpected
    return reference, lean


@pytest.mark.parametrize("kv_heads,bias", [(4, False), (2, False), (2, True)])
def test_full_sequence_with_left_padding(kv_heads, bias, grad_mode):
    reference, lean = _pair(kv_heads, bias=bias)
    if bias:  # nonzero biases, so the fast path's rotated biases are checked
        with torch.no_grad():
            for name, parameter in reference.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_()
        lean.load_state_dict(reference.state_dict(), strict=False)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    want = reference(inputs_embeds=x, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
    got = lean(x, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
    valid = mask.bool()
    assert torch.allclose(got[valid], want[valid], atol=1e-10)
    assert torch.isfinite(got).all()  # padded rows stay finite


def test_incremental_decoding_and_tree_masks(grad_mode):
    reference, lean = _pair()
    hf_cache, cache = DynamicCache(config=reference.config), lean.new_cache(2, max_length=4)  # grows
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    x = torch.randn(2, 4, 32, dtype=torch.float64)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    want = reference(inputs_embeds=x, attention_mask=mask, position_ids=positions, past_key_values=hf_cache).last_hidden_state
    got = lean(x, attention_mask=mask, position_ids=positions, past_key_values=cache).last_hidden_state
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-10)
    # two new tokens as a 2-D key mask continuing the chain
    step = torch.randn(2, 2, 32, dtype=torch.float64)
    full = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], 1)
    pos = positions[:, -1:] + torch.tensor([[1, 2]])
    want = reference(inputs_embeds=step, attention_mask=full, position_ids=pos, past_key_values=hf_cache).last_hidden_state
    got = lean(step, attention_mask=full, position_ids=pos, past_key_values=cache).last_hidden_state
    assert torch.allclose(got, want, atol=1e-10)
    # a 3-node tree (root, two siblings) as an explicit boolean visibility [B, 1, T, S+T]
    tree = torch.randn(2, 3, 32, dtype=torch.float64)
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    prefix = full.bool().unsqueeze(1).expand(2, 3, 6)
    visible = torch.cat([prefix, ancestors.expand(2, 3, 3)], 2).unsqueeze(1)
    pos = pos[:, -1:] + torch.tensor([[1, 2, 2]])
    want = reference(inputs_embeds=tree, attention_mask=visible, position_ids=pos, past_key_values=hf_cache).last_hidden_state
    got = lean(tree, attention_mask=visible, position_ids=pos, past_key_values=cache).last_hidden_state
    assert torch.allclose(got, want, atol=1e-10)
    assert cache.length == 9


def test_bad_masks():
    _, lean = _pair()
    x = torch.randn(1, 2, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="cover"):
        lean(x, attention_mask=torch.ones(1, 5, dtype=torch.long), use_cache=False)
    with pytest.raises(ValueError, match="additive"):
        lean(x, attention_mask=torch.zeros(1, 1, 2, 2), use_cache=False)
    with pytest.raises(ValueError, match="KVCache"):
        lean(x, past_key_values=DynamicCache())


def test_fast_path_follows_weight_changes():
    """The no-grad path's fused weights are rebuilt after an in-place update or a state-dict load."""
    reference, lean = _pair(kv_heads=2)
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        lean(x, use_cache=False)  # builds the fused weights
        for module in (lean, reference):
            module.layers[0].self_attn.k_proj.weight.mul_(1.5)
            module.layers[0].mlp.up_proj.weight.add_(0.1)
        want = reference(inputs_embeds=x, use_cache=False).last_hidden_state
        assert torch.allclose(lean(x, use_cache=False).last_hidden_state, want, atol=1e-10)
        _, other = _pair(kv_heads=2, seed=1)
        lean.load_state_dict(other.state_dict())
        assert torch.allclose(lean(x, use_cache=False).last_hidden_state,
                              other(x, use_cache=False).last_hidden_state, atol=1e-10)
        fast = lean(x, use_cache=False).last_hidden_state
    assert torch.allclose(fast, lean(x, use_cache=False).last_hidden_state, atol=1e-10)  # autograd path


def test_single_query_over_holes_and_positions_past_the_table(grad_mode):
    """One new token over a cache with holes (the drafting step's mask path), at positions beyond
    max_position_embeddings (the no-grad RoPE table grows)."""
    reference, lean = _pair()
    hf_cache, cache = DynamicCache(config=reference.config), lean.new_cache(2)
    mask = torch.tensor([[0, 1, 0, 1], [1, 1, 1, 0]])
    positions = torch.tensor([[0, 150, 0, 151], [300, 301, 302, 0]])  # past max_position_embeddings=128
    x = torch.randn(2, 4, 32, dtype=torch.float64)
    reference(inputs_embeds=x, attention_mask=mask, position_ids=positions, past_key_values=hf_cache)
    lean(x, attention_mask=mask, position_ids=positions, past_key_values=cache)
    step = torch.randn(2, 1, 32, dtype=torch.float64)
    full = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    pos = torch.tensor([[152], [303]])
    want = reference(inputs_embeds=step, attention_mask=full, position_ids=pos, past_key_values=hf_cache).last_hidden_state
    got = lean(step, attention_mask=full, position_ids=pos, past_key_values=cache).last_hidden_state
    assert torch.allclose(got, want, atol=1e-10)


def test_float32_matches_transformers(grad_mode):
    """In float32 RMSNorm runs torch's fused rms_norm: still transformers' numbers (to float32 rounding)."""
    reference, lean = _pair()
    reference, lean = reference.float(), lean.float()
    x = torch.randn(2, 5, 32)
    want = reference(inputs_embeds=x, use_cache=False).last_hidden_state
    got = lean(x, use_cache=False).last_hidden_state
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, reference(inputs_embeds=x + 1e-2, use_cache=False).last_hidden_state, atol=1e-5)


def test_all_valid_key_masks_take_the_plain_causal_path(grad_mode):
    """A 2-D key mask without padding or holes (every batch-1 draft step) is read once on the host and turned
    into a plain causal visibility over the cache (None for a single query); the outputs are transformers'."""
    from mmspec.models.lean_llama import _visibility

    assert _visibility(torch.ones(2, 5, dtype=torch.long), 2, 1, 4, torch.device("cpu")) is None
    plain = _visibility(torch.ones(2, 5, dtype=torch.long), 2, 3, 2, torch.device("cpu"))
    general = _visibility(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]).bool().unsqueeze(1)
                          .expand(2, 3, 5).tril(2).unsqueeze(1), 2, 3, 2, torch.device("cpu"))
    assert torch.equal(plain.expand(2, 1, 3, 5), general)
    reference, lean = _pair()
    hf_cache, cache = DynamicCache(config=reference.config), lean.new_cache(1, max_length=4)
    seen = 0
    for length in (3, 4, 1, 2):  # a prefill, then draft steps of several tokens and of one
        x = torch.randn(1, length, 32, dtype=torch.float64)
        mask = torch.ones(1, seen + length, dtype=torch.long)
        positions = torch.arange(seen, seen + length).unsqueeze(0)
        want = reference(inputs_embeds=x, attention_mask=mask, position_ids=positions,
                         past_key_values=hf_cache).last_hidden_state
        got = lean(x, attention_mask=mask, position_ids=positions, past_key_values=cache).last_hidden_state
        assert torch.allclose(got, want, atol=1e-10)
        seen += length
