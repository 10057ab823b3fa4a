"""LlamaGen-compatible AR image transformer and VQ tokenizer: official key layout, caches, trees, CFG."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import save_file

from mmspec import CausalLMRunner, ModelDrafter, TreeConfig, apply_guidance, speculative_generate
from mmspec.models.llamagen import LlamaGenTransformer, rope_2d
from mmspec.models.llamagen_vq import LlamaGenVQModel
from mmspec.runner import GuidedRunner
from mmspec.tree import tree_attention_mask, tree_position_offsets

V, GRID, CLASSES, WORDS = 40, 4, 5, 30
N = GRID * GRID


def tiny_gpt(model_type: str = "c2i", seed: int = 0, n_layer: int = 2, **overrides) -> LlamaGenTransformer:
    """A tiny random LlamaGen GPT in float64 with a sharpened head (so greedy choices are not ties)."""
    torch.manual_seed(seed)
    config = dict(dim=32, n_layer=n_layer, n_head=4, multiple_of=16, vocab_size=V, num_classes=CLASSES,
                  block_size=N, model_type=model_type)
    if model_type == "t2i":
        config.update(cls_token_num=6, caption_dim=24, text_vocab_size=WORDS)
    config.update(overrides)
    model = LlamaGenTransformer(**config).double().eval()
    with torch.no_grad():
        model.output.weight.mul_(30.0)
        for layer in model.layers:  # larger attention weights so positions and masks matter
            layer.attention.wqkv.weight.mul_(10.0)
    return model


def condition(model_type: str, batch: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if model_type == "c2i":
        return {"condition_ids": torch.randint(0, CLASSES, (batch,), generator=g)}
    return {"condition_ids": torch.randint(0, WORDS, (batch, 6), generator=g)}


def images(batch: int = 2, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (batch, N), generator=torch.Generator().manual_seed(seed))


OFFICIAL_GPT_KEYS = ["tok_embeddings.weight", "layers.0.attention.wqkv.weight", "layers.0.attention.wo.weight",
                     "layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w2.weight",
                     "layers.1.feed_forward.w3.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
                     "norm.weight", "output.weight"]


def test_parameter_names_follow_the_official_layout():
    c2i, t2i = tiny_gpt("c2i").state_dict(), tiny_gpt("t2i").state_dict()
    for key in OFFICIAL_GPT_KEYS:
        assert key in c2i and key in t2i
    assert c2i["cls_embedding.embedding_table.weight"].shape == (CLASSES + 1, 32)  # + the null class
    assert t2i["cls_embedding.cap_proj.fc1.weight"].shape == (32, 24)
    assert t2i["cls_embedding.cap_proj.fc2.weight"].shape == (32, 32)
    assert t2i["cls_embedding.uncond_embedding"].shape == (6, 24)
    assert t2i["text_embeddings.weight"].shape == (WORDS, 24)
    assert c2i["layers.0.feed_forward.w1.weight"].shape == (96, 32)  # find_multiple(int(2*128/3)=85, 16)


def test_rope_2d_rotates_rows_and_columns_and_zeroes_conditions():
    head_dim = 16
    rope = rope_2d(torch.tensor([[-1, 0, GRID + 3]]), GRID, head_dim, 10000.0, torch.float64)[0, :, 0]  # [3, 8]
    freqs = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert torch.equal(rope[0], torch.zeros(8, dtype=rope.dtype))  # condition: LlamaGen's zero entry
    assert torch.allclose(rope[1], torch.ones(8, dtype=rope.dtype))  # grid (0, 0): no rotation
    expected = torch.polar(torch.ones(8, dtype=torch.float64), torch.cat([1 * freqs, 3 * freqs]))  # (row 1, col 3)
    assert torch.allclose(rope[2], expected, atol=1e-15)


def test_condition_tokens_have_zero_queries_and_keys_as_in_llamagen():
    """LlamaGen's rotary table is (cos, sin) = (0, 0) at condition positions: their q and k vanish, so
    changing the q/k projections cannot change a condition-only prefill, only image tokens."""
    model, cond, toks = tiny_gpt("t2i"), condition("t2i"), images()
    before_prefill, before_image = model(**cond).logits, model.forward_train(image_tokens=toks, **cond)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wqkv.weight[:64].mul_(-2.5)  # the q and k rows (dim 32 each)
    assert torch.allclose(model(**cond).logits, before_prefill, atol=1e-12, rtol=0)
    assert not torch.allclose(model.forward_train(image_tokens=toks, **cond), before_image, atol=1e-3)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_save_pretrained_round_trip(tmp_path, model_type):
    model = tiny_gpt(model_type)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "diffusion_pytorch_model.safetensors").is_file()
    loaded = LlamaGenTransformer.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert loaded.config.model_type == model_type and loaded.config.text_vocab_size == model.config.text_vocab_size
    for name, tensor in model.state_dict().items():  # the t2i uncond buffer included
        assert torch.equal(loaded.state_dict()[name], tensor), name
    cond, toks = condition(model_type), images()
    # weights are bit-identical (checked above); matmuls on differently aligned buffers may differ in the last bit
    assert torch.allclose(loaded.forward_train(image_tokens=toks, **cond), model.forward_train(image_tokens=toks, **cond),
                          atol=1e-12, rtol=0)


@pytest.mark.parametrize("model_type,container,suffix", [("c2i", "model", ".pt"), ("c2i", "module", ".pth"),
                                                         ("t2i", "state_dict", ".pt"), ("t2i", None, ".safetensors")])
def test_official_checkpoint_layout_round_trip(tmp_path, model_type, container, suffix):
    model = tiny_gpt(model_type)
    state = {f"module._orig_mod.{k}": v.clone() for k, v in model.state_dict().items()}
    state["module.freqs_cis"] = torch.zeros(N + 1, 4, 2, dtype=torch.float64)  # official buffer, recomputed here
    path = tmp_path / f"ckpt{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:  # LlamaGen's training script also stores its argparse Namespace and the step
        ckpt = {container: state, "steps": 7, "args": argparse.Namespace(gpt_model="GPT-B")}
        torch.save(ckpt, path)
    # n_head (not readable from shapes for this width), grid and FFN rounding come from the user
    loaded = LlamaGenTransformer.from_llamagen_checkpoint(path, n_head=4, block_size=N, multiple_of=16)
    assert loaded.dtype == torch.float64  # the checkpoint's dtype
    inferred = loaded.config
    assert (inferred.model_type, inferred.vocab_size, inferred.dim, inferred.n_layer) == (model_type, V, 32, 2)
    if model_type == "c2i":
        assert inferred.num_classes == CLASSES and inferred.cls_token_num == 1
    else:
        assert (inferred.caption_dim, inferred.cls_token_num, inferred.text_vocab_size) == (24, 6, WORDS)
    assert not loaded.training
    cond, toks = condition(model_type), images()
    # weights are bit-identical (checked above); matmuls on differently aligned buffers may differ in the last bit
    assert torch.allclose(loaded.forward_train(image_tokens=toks, **cond), model.forward_train(image_tokens=toks, **cond),
                          atol=1e-12, rtol=0)


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    state = tiny_gpt().state_dict()
    del state["layers.1.ffn_norm.weight"]
    state["extra.weight"] = torch.zeros(3)
    torch.save({"model": state}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"missing keys \(1\): layers\.1\.ffn_norm\.weight.*unexpected keys \(1\): "
                                         r"extra\.weight"):
        LlamaGenTransformer.from_llamagen_checkpoint(tmp_path / "bad.pt", n_head=4, block_size=N, multiple_of=16)
    with pytest.raises(ValueError, match="shape mismatches.*feed_forward.w1"):  # wrong FFN rounding
        LlamaGenTransformer.from_llamagen_checkpoint(tmp_path / "bad.pt", n_head=4, block_size=N, multiple_of=64)
    torch.save({"model": {"conv.weight": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a LlamaGen GPT state dict"):
        LlamaGenTransformer.from_llamagen_checkpoint(tmp_path / "other.pt")
    torch.save({"model": tiny_gpt().state_dict()}, tmp_path / "odd_width.pt")
    with pytest.raises(ValueError, match="n_head"):  # width 32 is no official size
        LlamaGenTransformer.from_llamagen_checkpoint(tmp_path / "odd_width.pt", block_size=N, multiple_of=16)
    torch.save({"epoch": 3}, tmp_path / "empty.pt")
    with pytest.raises(ValueError, match="does not hold a state dict"):
        LlamaGenTransformer.from_llamagen_checkpoint(tmp_path / "empty.pt")
    with pytest.raises(FileNotFoundError):
        LlamaGenTransformer.from_llamagen_checkpoint(tmp_path / "missing.pt")


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_cached_decoding_equals_teacher_forcing(model_type):
    model, cond, toks = tiny_gpt(model_type), condition(model_type), images()
    full = model.forward_train(image_tokens=toks, **cond)  # [B, N, V]
    out = model(**cond)
    c = 1 if model_type == "c2i" else 6
    steps, cache = [out.logits[:, -1]], out.past_key_values
    for k in range(N - 1):  # one token at a time
        out = model(input_ids=toks[:, k:k + 1], past_key_values=cache, position_ids=torch.full((2, 1), c + k))
        steps.append(out.logits[:, -1])
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-10, rtol=0)
    # chunks of three with default positions and a 2-D key mask
    out = model(**cond)
    chunks, cache = [out.logits[:, -1:]], out.past_key_values
    for k in range(0, N - 1, 3):
        part = toks[:, k:min(k + 3, N - 1)]
        mask = torch.ones(2, cache.get_seq_length() + part.shape[1], dtype=torch.long)
        chunks.append(model(input_ids=part, past_key_values=cache, attention_mask=mask).logits)
    assert torch.allclose(torch.cat(chunks, 1), full, atol=1e-10, rtol=0)


def test_hidden_states_contract():
    model, cond = tiny_gpt(), condition("c2i")
    prefill = model(**cond, output_hidden_states=True)
    out = model(input_ids=images()[:, :3], past_key_values=prefill.past_key_values, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.n_layer + 1
    assert torch.allclose(model.output(out.hidden_states[-1]), out.logits, atol=1e-12)
    assert torch.equal(out.hidden_states[0], model.tok_embeddings(images()[:, :3]))
    assert model.get_output_embeddings() is model.output and model.get_input_embeddings() is model.tok_embeddings
    assert (model.hidden_size, model.vocab_size) == (32, V)


def test_padded_text_conditions_through_the_runner_match_unpadded():
    """LlamaGen left-pads captions and masks the padding: a padded row decodes like its unpadded self."""
    model = tiny_gpt("t2i")
    words = torch.randint(0, WORDS, (2, 4), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([4, 2])
    padded, mask = model.pad_condition(words, (torch.arange(4) < lengths[:, None]).long())
    assert padded.shape == (2, 6) and torch.equal(mask.sum(-1), lengths) and (padded[mask == 0] == -1).all()
    toks = images()
    runner = CausalLMRunner(model)
    logits = [runner.prefill(None, mask, condition_ids=padded).logits[:, -1]]
    for k in range(5):
        runner.begin_round()
        logits.append(runner.forward(toks[:, k:k + 1]).logits[:, 0])
        runner.commit(torch.zeros(2, 1, dtype=torch.long))
    for b in range(2):
        alone = model.forward_train(words[b:b + 1, :lengths[b]], toks[b:b + 1])[0, :6]
        assert torch.allclose(torch.stack(logits, 1)[b], alone, atol=1e-10, rtol=0)
        masked = model.forward_train(padded[b:b + 1], toks[b:b + 1], condition_mask=mask[b:b + 1])[0, :6]
        assert torch.allclose(masked, alone, atol=1e-10, rtol=0)


def test_tree_attention_forward_equals_chains_along_each_path():
    model = tiny_gpt()
    cond, toks = condition("c2i"), images()
    prefix = 3  # tokens 0..2 committed, token 3 is the root (pending) of the tree
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2], [-1, 0, 0, 2, 3, -1]])
    nodes = torch.randint(0, V, parents.shape, generator=torch.Generator().manual_seed(4))
    runner = CausalLMRunner(model)
    runner.prefill(None, torch.ones(2, 1, dtype=torch.long), **cond)
    runner.begin_round()
    runner.forward(toks[:, :prefix])
    runner.commit(torch.arange(prefix).expand(2, -1))
    runner.begin_round()
    before = torch.ones(2, parents.shape[1] + 1, runner.num_slots, dtype=torch.bool)
    out = runner.forward(torch.cat([toks[:, prefix:prefix + 1], nodes], 1), offsets=tree_position_offsets(parents),
                         attention=torch.cat([before, tree_attention_mask(parents)], 2))
    for b in range(2):
        for i in range(-1, parents.shape[1]):  # -1 = the root
            path, node = [], i
            while node >= 0:
                path.insert(0, int(nodes[b, node]))
                node = int(parents[b, node])
            chain = torch.cat([toks[b, :prefix + 1], torch.tensor(path, dtype=torch.long), torch.zeros(1).long()])
            expected = model.forward_train(cond["condition_ids"][b:b + 1], chain[None])[0, prefix + 1 + len(path)]
            assert torch.allclose(out.logits[b, i + 1], expected, atol=1e-10, rtol=0), (b, i)


def test_four_d_mask_is_used_as_given_and_padding_rows_stay_finite():
    model = tiny_gpt()
    prefill = model(**condition("c2i"))
    cache = prefill.past_key_values
    visible = torch.tril(torch.ones(3, 4, dtype=torch.bool), diagonal=1).expand(2, 1, 3, 4).clone()
    visible[0, 0, 2] = False  # a padding slot that sees nothing (the model adds its own slot)
    visible[1, 0, 1, 1] = False  # slot 1 of row 1 does not see slot 0 (a sibling, not an ancestor)
    out = model(input_ids=images()[:, :3], past_key_values=cache, attention_mask=visible,
                position_ids=torch.tensor([[1, 2, 3], [1, 1, 2]]))
    assert torch.isfinite(out.logits).all()
    cache.crop(1)
    itself = visible.clone()
    itself[0, 0, 2, 3] = True  # what the model does for a slot that sees nothing: it sees its own slot
    again = model(input_ids=images()[:, :3], past_key_values=cache, attention_mask=itself,
                  position_ids=torch.tensor([[1, 2, 3], [1, 1, 2]]))
    assert torch.equal(again.logits, out.logits)
    alone = model(condition_ids=condition("c2i")["condition_ids"][1:])
    single = model(input_ids=images()[1:2, 1:2], past_key_values=alone.past_key_values, position_ids=torch.tensor([[1]]))
    assert torch.allclose(out.logits[1, 1], single.logits[0, 0], atol=1e-10, rtol=0)  # a sibling of slot 0
    cache.crop(1)
    with pytest.raises(ValueError, match="4-D attention_mask must be bool"):
        model(input_ids=images()[:, :3], past_key_values=cache, attention_mask=visible.double())


def _greedy_reference(model, cond, steps, guidance=None):
    """A plain loop over the model: guided rows are ``[cond; uncond]`` with the null condition."""
    batch = next(iter(cond.values())).shape[0]
    if guidance is not None:
        cond = {k: torch.cat([v, v]) for k, v in cond.items()}
        cond["condition_drop"] = torch.arange(2 * batch) >= batch
    out = model(**cond)
    tokens = []
    for _ in range(steps):
        logits = out.logits[:, -1] if guidance is None else apply_guidance(out.logits[:, -1], guidance)
        tokens.append(logits.argmax(-1))
        feed = tokens[-1] if guidance is None else torch.cat([tokens[-1], tokens[-1]])
        out = model(input_ids=feed[:, None], past_key_values=out.past_key_values)
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_speculation_loop_drives_the_model_as_target_and_drafter(model_type):
    target, draft = tiny_gpt(model_type, n_layer=3), tiny_gpt(model_type, seed=5, n_layer=1)
    cond = condition(model_type)
    mask = torch.ones(2, next(iter(cond.values())).reshape(2, -1).shape[1], dtype=torch.long)
    reference = _greedy_reference(target, cond, N)
    baseline = speculative_generate(CausalLMRunner(target), None, None, mask, max_new_tokens=N, **cond)
    assert torch.equal(baseline.sequences, reference)
    for drafter in (ModelDrafter(draft, 3), ModelDrafter(target, tree=TreeConfig(depth=3, top_k=2, total_tokens=8))):
        spec = speculative_generate(CausalLMRunner(target), drafter, None, mask, max_new_tokens=N, **cond)
        assert torch.equal(spec.sequences, reference)
    assert spec.stats.target_calls < baseline.stats.target_calls / 2  # self-drafting: every draft accepted


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_classifier_free_guidance_doubled_batch_equals_manual_loop(model_type):
    target, draft = tiny_gpt(model_type, n_layer=3), tiny_gpt(model_type, seed=5, n_layer=1)
    scale = 3.0
    cond = condition(model_type)
    reference = _greedy_reference(target, cond, N, guidance=scale)
    assert not torch.equal(reference, _greedy_reference(target, cond, N))  # guidance changes the image
    doubled = {k: torch.cat([v, v]) for k, v in cond.items()}
    doubled["condition_drop"] = torch.tensor([False, False, True, True])
    mask = torch.ones(4, next(iter(cond.values())).reshape(2, -1).shape[1], dtype=torch.long)
    guided = speculative_generate(GuidedRunner(CausalLMRunner(target), scale), None, None, mask,
                                  max_new_tokens=N, **doubled)
    assert torch.equal(guided.sequences, reference)
    drafter = ModelDrafter(GuidedRunner(CausalLMRunner(draft), scale), 3)
    spec = speculative_generate(GuidedRunner(CausalLMRunner(target), scale), drafter, None, mask,
                                max_new_tokens=N, **doubled)
    assert torch.equal(spec.sequences, reference)


def test_bad_inputs_raise_value_errors():
    model, t2i = tiny_gpt(), tiny_gpt("t2i")
    with pytest.raises(ValueError, match="input_ids has ids outside"):
        model(input_ids=torch.tensor([[V]]), past_key_values=model(**condition("c2i", 1)).past_key_values)
    with pytest.raises(ValueError, match="condition_ids has ids outside"):
        model(condition_ids=torch.tensor([CLASSES]))
    with pytest.raises(ValueError, match="class ids"):
        model(condition_embeds=torch.zeros(1, 1, 24))
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=torch.tensor([[1]]), condition_ids=torch.tensor([1]))
    with pytest.raises(ValueError, match="needs exactly one"):
        model()
    with pytest.raises(ValueError, match="1..6"):
        t2i(condition_ids=torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="condition_embeds must be"):
        t2i(condition_embeds=torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="class_dropout_prob=0"):
        tiny_gpt(class_dropout_prob=0.0)(condition_ids=torch.tensor([1]), condition_drop=torch.tensor([True]))
    with pytest.raises(ValueError, match="2-D attention_mask"):
        model(condition_ids=torch.tensor([1]), attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="block_size must be a square"):
        LlamaGenTransformer(dim=32, n_head=4, block_size=15)
    with pytest.raises(ValueError, match="model_type"):
        LlamaGenTransformer(dim=32, n_head=4, model_type="t2v")
    with pytest.raises(ValueError, match="image_tokens"):
        model.forward_train(condition_ids=torch.tensor([1]), image_tokens=torch.zeros(1, N + 1, dtype=torch.long))


def test_training_forward_is_differentiable_and_drops_labels_in_train_mode():
    model = tiny_gpt().float().train()
    cond, toks = condition("c2i", batch=64), images(batch=64)
    torch.manual_seed(0)
    loss = torch.nn.functional.cross_entropy(model.forward_train(image_tokens=toks, **cond).flatten(0, 1),
                                             toks.flatten())
    loss.backward()
    assert model.layers[0].attention.wqkv.weight.grad.abs().sum() > 0
    assert model.cls_embedding.embedding_table.weight.grad[CLASSES].abs().sum() > 0  # some rows got the null class
    model.eval()
    same = model.forward_train(image_tokens=toks, **cond)
    assert torch.equal(same, model.forward_train(image_tokens=toks, **cond))  # eval: no dropout


# ---------------------------------------------------------------------------------------------------
# VQ tokenizer
# ---------------------------------------------------------------------------------------------------


def tiny_vq(codebook_size: int = 64, seed: int = 0) -> LlamaGenVQModel:
    torch.manual_seed(seed)
    return LlamaGenVQModel(codebook_size=codebook_size, codebook_embed_dim=8, encoder_ch_mult=[1, 2],
                           decoder_ch_mult=[1, 2], z_channels=32, ch=32, num_res_blocks=1).eval()


def test_vq_encode_decode_shapes_and_official_names():
    vq = tiny_vq()
    x = torch.rand(2, 3, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1
    tokens = vq.encode(x)
    assert tokens.shape == (2, 8, 12) and tokens.dtype == torch.long
    assert tokens.min() >= 0 and tokens.max() < 64 and tokens.unique().numel() > 1
    images = vq.decode(tokens)
    assert images.shape == (2, 3, 16, 24) and images.min() >= -1 and images.max() <= 1
    # nearest entry under cosine: re-encoding a code's own direction finds it
    codebook = vq.codebook_embeddings()
    assert torch.allclose(codebook.norm(dim=-1), torch.ones(64))
    assert torch.equal(vq.quantize.nearest(codebook * 3.0), torch.arange(64))
    names = vq.state_dict()
    for key in ("encoder.conv_in.weight", "encoder.conv_blocks.0.res.0.norm1.weight",
                "encoder.conv_blocks.0.downsample.conv.weight", "encoder.conv_blocks.1.res.0.nin_shortcut.weight",
                "encoder.conv_blocks.1.attn.0.q.weight", "encoder.mid.1.proj_out.weight", "encoder.norm_out.weight",
                "decoder.conv_blocks.0.attn.1.k.weight", "decoder.conv_blocks.0.upsample.conv.weight",
                "decoder.mid.2.conv2.weight", "quantize.embedding.weight", "quant_conv.weight", "post_quant_conv.bias"):
        assert key in names, key
    assert names["quantize.embedding.weight"].shape == (64, 8)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        vq.encode(x + 1.5)
    with pytest.raises(ValueError, match="multiples of 2"):
        vq.encode(torch.zeros(1, 3, 15, 16))
    with pytest.raises(ValueError, match="outside"):
        vq.decode(torch.full((1, 2, 2), 64))


def test_vq_codebook_neighbors_small_matches_brute_force():
    vq = tiny_vq()
    neighbors = vq.codebook_neighbors(5, chunk=7)  # several chunks
    codebook = vq.codebook_embeddings().double()
    d2 = torch.cdist(codebook, codebook).pow(2).fill_diagonal_(float("inf"))
    assert neighbors.shape == (64, 5)
    assert not (neighbors == torch.arange(64)[:, None]).any()
    dist = d2.gather(1, neighbors)
    assert (dist[:, 1:] >= dist[:, :-1] - 1e-12).all()
    assert torch.allclose(dist, d2.sort(-1).values[:, :5], atol=1e-12)  # the k smallest, in order
    with pytest.raises(ValueError, match="k must be"):
        vq.codebook_neighbors(64)


@pytest.mark.slow
def test_vq_codebook_neighbors_full_size_codebook():
    vq = LlamaGenVQModel(encoder_ch_mult=[1], decoder_ch_mult=[1], z_channels=32, ch=32, num_res_blocks=1)
    assert vq.quantize.embedding.weight.shape == (16384, 8)  # LlamaGen's default codebook
    neighbors = vq.codebook_neighbors(4)
    assert neighbors.shape == (16384, 4)
    assert not (neighbors == torch.arange(16384)[:, None]).any()
    codebook = vq.codebook_embeddings().double()
    rows = torch.randint(0, 16384, (32,), generator=torch.Generator().manual_seed(0))
    d2 = torch.cdist(codebook[rows], codebook).pow(2)
    d2[torch.arange(32), rows] = float("inf")
    assert torch.allclose(d2.gather(1, neighbors[rows]), d2.sort(-1).values[:, :4], atol=1e-12)


def test_vq_official_checkpoint_and_save_pretrained_round_trips(tmp_path):
    vq = tiny_vq()
    state = {f"module.{k}": v for k, v in vq.state_dict().items()}
    state["module.quantize.codebook_used"] = torch.zeros(65536)  # LlamaGen's usage buffer
    torch.save({"state_dict": state, "optimizer": {}}, tmp_path / "vq.pt")
    loaded = LlamaGenVQModel.from_llamagen_checkpoint(tmp_path / "vq.pt")
    config = loaded.config
    assert (config.codebook_size, config.ch, config.z_channels, config.num_res_blocks) == (64, 32, 32, 1)
    assert list(config.encoder_ch_mult) == [1, 2] and list(config.decoder_ch_mult) == [1, 2]
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    tokens = vq.encode(x)
    assert torch.equal(loaded.encode(x), tokens)
    assert torch.equal(loaded.decode(tokens), vq.decode(tokens))
    vq.save_pretrained(tmp_path / "saved")
    again = LlamaGenVQModel.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(again.decode(tokens), vq.decode(tokens))
    del state["module.post_quant_conv.bias"]
    torch.save({"model": state}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"missing keys \(1\): post_quant_conv\.bias"):
        LlamaGenVQModel.from_llamagen_checkpoint(tmp_path / "bad.pt")
    torch.save({"model": tiny_gpt().state_dict()}, tmp_path / "gpt.pt")
    with pytest.raises(ValueError, match="not a LlamaGen VQ state dict"):
        LlamaGenVQModel.from_llamagen_checkpoint(tmp_path / "gpt.pt")
