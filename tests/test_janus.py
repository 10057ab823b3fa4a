"""Janus-Pro adapter: the contract is Janus's own computation, and speculative methods stay lossless on it.

A tiny random ``JanusForConditionalGeneration`` (2-layer Llama of width 32, 6x6 image tokens, codebook of
32, a 12x12-pixel VQ decoder) and a word-level HF tokenizer are saved to a temporary folder and reloaded
offline through :meth:`JanusImageGenerator.from_pretrained`, as a real checkpoint would be. fp32 on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmspec import TreeConfig
from mmspec.methods.eagle import EagleConfig, LanternConfig
from mmspec.methods.jacobi import SJDConfig
from mmspec.models.eagle import EagleHead
from mmspec.models.janus import (
    JanusImageGenerator,
    JanusPromptTokenizer,
    JanusVQDecoder,
    load_janus_components,
)
from mmspec.pipelines import ARImagePipeline

WIDTH, V, GRID = 32, 32, 6
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>", "<|User|>", "<|Assistant|>", "<image_placeholder>", "<begin_of_image>",
           "<end_of_image>"]
WORDS = [":", "a", "and", "blue", "circle", "green", "red", "square", "triangle"]
PROMPTS = ["a red circle", "a blue square and a green triangle"]
MAX_PROMPT = 20


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens={"boi_token": "<begin_of_image>"})


def tiny_janus(vocab_size: int):
    from transformers import (
        JanusConfig,
        JanusForConditionalGeneration,
        JanusVisionConfig,
        JanusVQVAEConfig,
        LlamaConfig,
    )

    text = LlamaConfig(vocab_size=vocab_size, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                       bos_token_id=2, eos_token_id=3)
    vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=4 * GRID,
                               patch_size=4, projection_dim=WIDTH, num_image_tokens=GRID * GRID, mlp_ratio=2)
    vq = JanusVQVAEConfig(embed_dim=4, num_embeddings=V, latent_channels=32, base_channels=32,
                          channel_multiplier=[1, 1], num_res_blocks=1, projection_dim=WIDTH, num_hidden_layers=2,
                          image_token_embed_dim=WIDTH)  # GroupNorm(32) needs 32 channels; 6x6 tokens -> 12x12 px
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                         image_token_id=SPECIAL.index("<image_placeholder>"))
    torch.manual_seed(0)
    model = JanusForConditionalGeneration(config).eval()
    with torch.no_grad():
        # Random init is near-uniform and its layers barely touch the residual stream (the next token would
        # depend on the last one only: constant images). Stronger layers and a sharper head give varied,
        # clearly-won greedy tokens (8+ distinct ones per image) that a copy head still partly predicts.
        model.model.generation_head.vision_head.weight.mul_(20.0)
        for layer in model.model.language_model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                           mlp.up_proj, mlp.down_proj):
                linear.weight.mul_(8.0)
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def copy_head() -> EagleHead:
    """An EAGLE head that drafts the previous token's distribution again (fc passes the feature through)."""
    torch.manual_seed(1)
    head = EagleHead(hidden_size=WIDTH, vocab_size=V, num_attention_heads=4)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, WIDTH:] = torch.eye(WIDTH)
        head.fc.bias.zero_()
        head.decoder.layers[0].self_attn.o_proj.weight.zero_()
        head.decoder.layers[0].mlp.down_proj.weight.zero_()
    return head.eval()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny Janus checkpoint folder (model + tokenizer), like a downloaded hub snapshot."""
    folder = tmp_path_factory.mktemp("janus")
    tokenizer = tiny_tokenizer()
    tiny_janus(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def components(checkpoint):
    return load_janus_components(checkpoint, max_prompt_length=MAX_PROMPT)


@pytest.fixture(scope="module")
def pipe(components):
    pipeline = ARImagePipeline(**components, eagle_head=copy_head())
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def test_loaded_adapter_config(components):
    generator, tokenizer = components["transformer"], components["text_tokenizer"]
    config = generator.config
    assert (config.vocab_size, config.block_size, config.model_type, config.cls_token_num) == (V, GRID * GRID, "t2i",
                                                                                               MAX_PROMPT)
    assert config.text_vocab_size == len(tokenizer) and config.class_dropout_prob > 0 and config.pad_token_id == 0
    assert generator.get_output_embeddings().weight.shape == (V, WIDTH)
    assert components["vqvae"].vocab_size == V and not generator.training
    # the template: BOS, "<|User|>: prompt", "<|Assistant|>:", the image start tag
    ids = tokenizer.encode("a red circle")
    text = tokenizer.tokenizer.convert_ids_to_tokens(ids)
    assert text == ["<bos>", "<|User|>", ":", "a", "red", "circle", "<|Assistant|>", ":", "<begin_of_image>"]


def step_positions(positions: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, 3]`` of three image tokens after a prompt laid out with ``positions [B, C]``."""
    return positions[:, -1:] + 1 + torch.arange(3)


def test_logits_are_janus_computation(components):
    """Prefill (with a left-padded row and an unconditional row) + 3 image tokens against the HF model's own
    modules: language model on inputs_embeds, generation embedding + aligner, generation head."""
    generator, tokenizer = components["transformer"], components["text_tokenizer"]
    janus = generator.model
    condition = tokenizer.batch([PROMPTS[0], PROMPTS[1], PROMPTS[0]], MAX_PROMPT)  # [3, C], -1 left padding
    drop = torch.tensor([False, False, True])
    mask = (condition >= 0).long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    image = torch.randint(0, V, (3, 3), generator=torch.Generator().manual_seed(0))
    pre = generator(condition_ids=condition, condition_drop=drop, attention_mask=mask, position_ids=positions)
    full_mask = torch.cat([mask, torch.ones_like(image)], 1)
    step = generator(input_ids=image, attention_mask=full_mask, position_ids=step_positions(positions),
                     past_key_values=pre.past_key_values, output_hidden_states=True)

    # by hand: HF's unconditional prompt keeps BOS and <begin_of_image>, pads the rest (Janus's generate)
    text_ids = condition.clamp_min(0).clone()
    text_ids[~mask.bool()] = 0
    bos, boi = tokenizer.bos_token_id, tokenizer.boi_token_id
    keep = (text_ids[2] == bos) | (text_ids[2] == boi)
    text_ids[2] = torch.where(keep, text_ids[2], 0)
    embeds = torch.cat([janus.get_input_embeddings()(text_ids), janus.prepare_embeddings_for_image_generation(image)],
                       1)
    all_positions = torch.cat([positions, step_positions(positions)], 1)
    with torch.no_grad():
        hidden = janus.model.language_model(inputs_embeds=embeds, attention_mask=full_mask,
                                            position_ids=all_positions).last_hidden_state
        expected = janus.model.generation_head(hidden)
    real = mask.bool()
    torch.testing.assert_close(pre.logits[real], expected[:, :MAX_PROMPT][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.logits, expected[:, MAX_PROMPT:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.hidden_states[-1], hidden[:, MAX_PROMPT:], rtol=1e-5, atol=1e-5)
    assert pre.logits.shape == (3, MAX_PROMPT, V)
    assert not torch.allclose(pre.logits[0, -1], pre.logits[2, -1])  # the unconditional row differs
    uncond = generator.prompt_ids(condition[2:], torch.tensor([True]))[0, mask[2].bool()]
    assert uncond.tolist() == [bos] + [0] * (int(mask[2].sum()) - 2) + [boi]


def _tokens(pipe, method, prompts=PROMPTS, **kwargs):
    kwargs.setdefault("do_sample", False)
    return pipe(prompts, method=method, output_type="tokens", **kwargs).tokens


def test_baseline_equals_transformers_generate(pipe, components):
    """method='none' (greedy, guided) reproduces transformers' own Janus image generation token for token."""
    janus, tokenizer = components["transformer"].model, components["text_tokenizer"]
    ids = tokenizer.batch(PROMPTS, 13)  # as HF pads a batch: to the longest prompt, on the left
    mask = (ids >= 0).long()
    janus.generation_config.generation_kwargs = {"boi_token_id": tokenizer.boi_token_id}
    expected = janus.generate(ids.clamp_min(0), attention_mask=mask, generation_mode="image", do_sample=False,
                              guidance_scale=4.0)
    tokens = _tokens(pipe, "none", guidance_scale=4.0)
    assert torch.equal(tokens.reshape(2, -1), expected)
    assert len(set(tokens.flatten().tolist())) > 3  # not a degenerate constant image


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_speculative_methods_are_lossless_greedy(pipe, guidance_scale):
    baseline = _tokens(pipe, "none", guidance_scale=guidance_scale)
    chain = pipe(PROMPTS, method=EagleConfig(num_draft_tokens=4), do_sample=False, guidance_scale=guidance_scale,
                 output_type="tokens")
    assert torch.equal(chain.tokens, baseline)
    assert len(baseline.unique()) >= 6  # a varied image, not one repeated token
    # drafts were accepted (rounds produced > 1 token), so the equality says something
    assert chain.stats.target_calls < GRID * GRID and chain.stats.mean_accepted_length > 1.3
    tree = pipe(PROMPTS, method=EagleConfig(tree=TreeConfig(depth=3, top_k=2, total_tokens=6)), do_sample=False,
                guidance_scale=guidance_scale, output_type="tokens")
    assert torch.equal(tree.tokens, baseline) and tree.stats.mean_accepted_length > 1.3
    jacobi = pipe(PROMPTS, method=SJDConfig(window=5), do_sample=False, guidance_scale=guidance_scale,
                  output_type="tokens")
    assert torch.equal(jacobi.tokens, baseline) and jacobi.stats.mean_accepted_length > 1.3


def test_lantern_uses_the_codebook(pipe):
    """LANTERN reads the VQ codebook's neighbours; delta=0 is exact, so greedy tokens equal the baseline."""
    baseline = _tokens(pipe, "none", guidance_scale=2.0)
    exact = _tokens(pipe, LanternConfig(k=4, delta=0.0), guidance_scale=2.0)
    assert torch.equal(exact, baseline)
    relaxed = pipe(PROMPTS, method=LanternConfig(k=4, delta=0.5), do_sample=False, guidance_scale=2.0,
                   output_type="tokens")
    assert relaxed.tokens.shape == baseline.shape and 0 <= relaxed.tokens.min() and relaxed.tokens.max() < V
    assert relaxed.stats.mean_accepted_length >= pipe(PROMPTS, method="eagle", do_sample=False, guidance_scale=2.0,
                                                      output_type="tokens").stats.mean_accepted_length


def test_images_decode(pipe, components):
    out = pipe(PROMPTS[0], method="eagle", do_sample=True, guidance_scale=3.0, output_type="pt",
               generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, 3, 2 * GRID, 2 * GRID) and out.tokens.shape == (1, GRID, GRID)
    assert out.images.min() >= 0 and out.images.max() <= 1 and out.images.std() > 0
    janus = components["transformer"].model
    with torch.no_grad():
        reference = janus.decode_image_tokens(out.tokens.reshape(1, -1)).permute(0, 3, 1, 2)  # Janus's [-1, 1]
    torch.testing.assert_close(out.images, ((reference + 1) / 2).clamp(0, 1))
    pil = pipe(PROMPTS[0], method="none", do_sample=False, guidance_scale=1.0).images
    assert pil[0].size == (2 * GRID, 2 * GRID)


def test_codebook_neighbors(components):
    vq = components["vqvae"]
    neighbors = vq.codebook_neighbors(5)
    codebook = vq.codebook_embeddings().double()
    distances = torch.cdist(codebook, codebook)
    assert neighbors.shape == (V, 5) and not (neighbors == torch.arange(V)[:, None]).any()
    got = distances.gather(1, neighbors)
    assert (got[:, 1:] >= got[:, :-1]).all()  # nearest first
    distances.fill_diagonal_(float("inf"))
    torch.testing.assert_close(got, distances.sort(-1).values[:, :5])
    assert torch.allclose(codebook.norm(dim=-1), torch.ones(V, dtype=torch.float64))  # Janus decodes normalised entries


def test_save_and_reload(tmp_path, pipe, components):
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["mmspec.models.janus", "JanusImageGenerator"]
    assert (tmp_path / "transformer" / "tokenizer_config.json").is_file()  # transformer/ is a full Janus checkpoint
    tokenizer = JanusPromptTokenizer.from_pretrained(tmp_path / "transformer")
    assert tokenizer.max_length == MAX_PROMPT
    reloaded = ARImagePipeline.from_pretrained(tmp_path)  # the tokenizer comes back through the adapter's hook
    assert reloaded.text_tokenizer.encode("red square") == tokenizer.encode("red square")
    reloaded.set_progress_bar_config(disable=True)
    assert isinstance(reloaded.transformer, JanusImageGenerator) and isinstance(reloaded.vqvae, JanusVQDecoder)
    assert reloaded.transformer.config.cls_token_num == MAX_PROMPT
    assert torch.equal(_tokens(reloaded, "eagle", guidance_scale=2.0), _tokens(pipe, "none", guidance_scale=2.0))
    tokens = torch.randint(0, V, (2, GRID, GRID), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(reloaded.vqvae.decode(tokens), components["vqvae"].decode(tokens))
    # the VQ decoder also loads straight from a full Janus checkpoint
    from_checkpoint = JanusVQDecoder.from_pretrained(tmp_path / "transformer")
    torch.testing.assert_close(from_checkpoint.decode(tokens), components["vqvae"].decode(tokens))


def test_bad_inputs(tmp_path, pipe, components, checkpoint):
    with pytest.raises(ValueError, match="max_length=20"):
        pipe(" ".join(["red"] * 30), method="none")
    with pytest.raises(ValueError, match="prompt 1 .*unknown token"):
        pipe(["a red circle", "a purple circle"], method="none")
    with pytest.raises(ValueError, match="empty"):
        pipe("   ", method="none")
    generator = components["transformer"]
    with pytest.raises(ValueError, match=r"input_ids has image token ids outside \[0, 32\)"):
        generator(input_ids=torch.tensor([[V]]))
    with pytest.raises(ValueError, match="condition_drop .* needs condition_ids"):
        generator(input_ids=torch.tensor([[0]]), condition_drop=torch.tensor([True]))
    with pytest.raises(ValueError, match="max_prompt_length=20"):
        generator(condition_ids=torch.full((1, MAX_PROMPT + 1), 2))
    with pytest.raises(ValueError, match=r"token grid \[B, 6, 6\]"):
        components["vqvae"].decode(torch.zeros(1, 4, 4, dtype=torch.long))
    with pytest.raises(FileNotFoundError, match="no folder"):
        JanusImageGenerator.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        JanusImageGenerator.from_pretrained(tmp_path)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' checkpoint, not Janus"):
        JanusImageGenerator.from_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="max_prompt_length must be an integer >= 2"):
        JanusImageGenerator(generator.model, max_prompt_length=1)
    with pytest.raises(ValueError, match="JanusForConditionalGeneration"):
        JanusImageGenerator(torch.nn.Linear(2, 2))
    bare = tiny_tokenizer()
    with pytest.raises(ValueError, match="no image start token '<eoi>'"):
        JanusPromptTokenizer(bare, boi_token="<eoi>")
