"""Packed oneDNN GEMMs for CPU linears (mmspec.cpu_gemm): same results as F.linear, routing by size,
fallbacks, repacking, removal, copies; on the zoo, speculative decoding stays lossless with them."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from pipeline_utils import quiet_pipeline
from torch import nn

from mmspec import TreeConfig
from mmspec.cpu_gemm import (
    PackedLinear,
    is_packed,
    onednn_linear_available,
    pack_cpu_linears,
)

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this PyTorch build has no oneDNN linear ops")


def two_layers(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(192, 512), nn.SiLU(), nn.Linear(512, 192, bias=False))


def packed_state(layer: nn.Module):
    return layer.__dict__["_mmspec_packed_gemm"]


@pytest.mark.parametrize("shape", [(1, 192), (4, 192), (2, 13, 192), (3, 5, 7, 192)])
def test_packed_layers_compute_what_f_linear_computes(shape):
    model = two_layers()
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = model(x)
    handle = pack_cpu_linears(model, min_macs=0)  # every call takes the packed kernel
    assert len(handle) == 2 and all(isinstance(layer, PackedLinear) for layer in (model[0], model[2]))
    with torch.inference_mode():
        got = model(x)
    assert packed_state(model[0]).packed is not None  # the packed kernel ran
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a non-contiguous input
        torch.testing.assert_close(model(x.transpose(0, -2)), expected.transpose(0, -2), rtol=1e-5, atol=1e-5)


def test_small_calls_keep_f_linear_and_large_calls_take_the_packed_kernel():
    layer = nn.Linear(192, 512)
    pack_cpu_linears(layer, min_macs=4 * 192 * 512)
    small, large = torch.randn(3, 192), torch.randn(4, 192)
    with torch.no_grad():
        assert torch.equal(layer(small), F.linear(small, layer.weight, layer.bias))  # bit-identical: F.linear
        assert packed_state(layer).packed is None
        torch.testing.assert_close(layer(large), F.linear(large, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert packed_state(layer).packed is not None


def test_training_other_dtypes_and_bad_arguments_fall_back_or_raise():
    model = two_layers()
    reference = copy.deepcopy(model)
    pack_cpu_linears(model, min_macs=0)
    x = torch.randn(6, 192)
    model(x).square().sum().backward()  # autograd: the F.linear path, same gradients
    reference(x).square().sum().backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    assert packed_state(model[0]).packed is None
    model.to(torch.bfloat16)  # a cast after packing: bf16 calls take F.linear (PyTorch's own oneDNN path)
    with torch.no_grad():
        assert torch.equal(model(x.bfloat16()), reference.to(torch.bfloat16)(x.bfloat16()))
    assert len(pack_cpu_linears(nn.Linear(4, 4).to(torch.bfloat16))) == 0  # only fp32 layers are packed
    with pytest.raises(ValueError, match="min_macs"):
        pack_cpu_linears(model, min_macs=-1)
    with pytest.raises(TypeError, match="nn.Module"):
        pack_cpu_linears([torch.zeros(2)])


def test_an_updated_weight_is_repacked():
    layer = nn.Linear(192, 512)
    pack_cpu_linears(layer, min_macs=0)
    x = torch.randn(8, 192)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2.0)  # in place
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(512, 192))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_removal_copies_pickles_and_state_dicts():
    model = two_layers()
    keys = list(model.state_dict())
    handle = pack_cpu_linears(model, min_macs=0)
    assert len(pack_cpu_linears(model, min_macs=0)) == 0  # already packed
    x = torch.randn(8, 192)
    with torch.no_grad():
        expected = model(x)
        clone = copy.deepcopy(model)  # after a packed call: the opaque packed tensor is not copied, rebuilt
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for other in (clone, loaded):
            assert is_packed(other[0]) and other[0].forward.__self__ is other[0]
            torch.testing.assert_close(other(x), expected)
    assert list(model.state_dict()) == keys
    handle.remove()
    assert type(model[0]) is nn.Linear and not is_packed(model[0]) and len(handle) == 0
    assert "_mmspec_packed_gemm" not in model[0].__dict__ and is_packed(clone[0])


def test_pipeline_switches_and_keeps_saving_plain_state(tmp_path):
    from tiny_shapes_pipeline import save_tiny_shapes_pipeline

    from mmspec.pipelines import ARImagePipeline

    folder = save_tiny_shapes_pipeline(tmp_path / "tiny")
    pipe = ARImagePipeline.from_pretrained(folder)
    assert not pipe.packed_cpu_gemm
    count = pipe.enable_packed_cpu_gemm()
    assert count > 0 and pipe.packed_cpu_gemm and pipe.enable_packed_cpu_gemm() == 0
    pipe.save_pretrained(tmp_path / "saved")
    reloaded = ARImagePipeline.from_pretrained(tmp_path / "saved")
    assert not reloaded.packed_cpu_gemm  # packing is a runtime setting, not saved
    pipe.set_cpu_gemm("plain")
    assert not pipe.packed_cpu_gemm
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        pipe.set_cpu_gemm("mkl")


@pytest.fixture(scope="module")
def packed_zoo():
    from mmspec.pipelines import ARImagePipeline

    pipe = quiet_pipeline(ARImagePipeline, "mmspec/shapes-t2i")
    pipe.enable_packed_cpu_gemm()
    return pipe


def test_greedy_speculative_decoding_stays_lossless_with_packed_gemms_on_the_zoo(packed_zoo):
    """With the default routing the single-token baseline mostly keeps F.linear while verification forwards
    take the packed kernel; greedy outputs must still be the baseline's exactly (fp32)."""
    from mmspec.methods.eagle import EagleConfig

    prompts = ["a red circle", "a blue square above a green triangle", "two yellow circles", "a small purple square"]
    kwargs = dict(do_sample=False, output_type="tokens")
    baseline = packed_zoo(prompts, method="none", **kwargs)
    blocks_chain = packed_zoo.method_config("eagle", do_sample=False)  # the zoo's greedy block chain with a tail
    blocks = packed_zoo(prompts, method=blocks_chain, **kwargs)
    tree = packed_zoo(prompts[:2], method=EagleConfig(tree=TreeConfig(depth=6, top_k=4, total_tokens=24)), **kwargs)
    single = [packed_zoo(p, method="eagle", **kwargs) for p in prompts]
    assert packed_state(packed_zoo.transformer.layers[0].feed_forward.w1).packed is not None
    assert torch.equal(blocks.tokens, baseline.tokens) and torch.equal(tree.tokens, baseline.tokens[:2])
    assert all(torch.equal(out.tokens[0], baseline.tokens[i]) for i, out in enumerate(single))
    assert blocks.stats.mean_accepted_length > 3.0


def test_gemm_microbenchmark_writes_its_table(tmp_path, capsys):
    import argparse

    from mmspec.evaluation import bench_gemm

    out = tmp_path / "gemm.md"
    assert bench_gemm.main(["--shapes", "16x32", "--rows", "1", "8", "--threads", "1", "--calls", "3",
                            "--repeats", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 1 | 16 x 32 |" in text and "8 rows" in text and "bench_gemm --shapes 16x32" in text
    assert text.strip() in capsys.readouterr().out
    with pytest.raises(argparse.ArgumentTypeError, match="IN x OUT"):
        bench_gemm.parse_shape("192")
    with pytest.raises(SystemExit, match="must be positive"):
        bench_gemm.main(["--rows", "0"])


def test_fused_weights_of_the_lean_draft_decoder_follow_their_layers_packing():
    """The lean decoder's inference path multiplies by weights concatenated from several projections; a
    LinearRoute sends those calls to the packed kernel exactly while the projections are packed."""
    from transformers import LlamaConfig

    from mmspec.cpu_gemm import LinearRoute
    from mmspec.models.lean_llama import LeanLlamaDecoder

    config = LlamaConfig(hidden_size=192, intermediate_size=512, num_attention_heads=4, num_hidden_layers=1,
                         vocab_size=64)
    torch.manual_seed(0)
    decoder = LeanLlamaDecoder(config).eval()
    embeds = torch.randn(2, 9, 192)
    with torch.inference_mode():
        expected = decoder(inputs_embeds=embeds).last_hidden_state
        handle = pack_cpu_linears(decoder, min_macs=0)
        got = decoder(inputs_embeds=embeds).last_hidden_state
    routes = [m._route for m in decoder.modules() if isinstance(getattr(m, "_route", None), LinearRoute)]
    assert len(routes) == 2 and all(route._state is not None and route._state.packed is not None for route in routes)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    handle.remove()
    route = LinearRoute()
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(route(x, weight, None, like=nn.Linear(8, 5)), F.linear(x, weight))  # unpacked: F.linear
    assert route._state is None and copy.deepcopy(route)._state is None
