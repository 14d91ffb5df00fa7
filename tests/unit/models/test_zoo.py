"""Model zoo: tiny-llama build/load/tokenizer, SmolLM2 GGUF conversion, user errors, chat rendering."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may come from a hub

import hashlib
import time
from pathlib import Path

import pytest
import torch

from sluiceway.infra.errors import UserError
from sluiceway.models.chat import encode_prompt, render_prompt
from sluiceway.models.tiny import build_tiny_llama
from sluiceway.models.zoo import ZOO, load_hf_model, load_tokenizer, model_cache_dir, resolve_checkpoint


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def zoo_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo_cache")


@pytest.fixture(scope="session")
def tiny_dir(zoo_cache) -> Path:
    return resolve_checkpoint("tiny-llama", cache_dir=zoo_cache)


@pytest.fixture(scope="session")
def smollm2_dir(zoo_cache) -> Path:
    t0 = time.perf_counter()
    path = resolve_checkpoint("smollm2-135m-instruct", cache_dir=zoo_cache)
    print(f"\nsmollm2 conversion: {time.perf_counter() - t0:.1f}s")
    return path


# --- tiny-llama -------------------------------------------------------------------------------------------


def test_tiny_builds_into_cache_layout(tiny_dir, zoo_cache):
    assert tiny_dir == (zoo_cache / "models" / f"tiny-llama-{ZOO['tiny-llama'].recipe_version}").resolve()
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tiny_dir / f).is_file(), f
    # No temp directory of the build is left beside it.
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]
    # A second resolve reuses the cache instead of rebuilding.
    mtime = os.path.getmtime(tiny_dir / "model.safetensors")
    assert resolve_checkpoint("tiny-llama", cache_dir=zoo_cache) == tiny_dir
    assert os.path.getmtime(tiny_dir / "model.safetensors") == mtime


def test_tiny_loads_and_runs(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    model = load_hf_model(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        64,
        2,
        4,
        2,
    )
    assert cfg.vocab_size == len(tok) and 512 <= len(tok) <= 1024
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id
    assert tok.bos_token == tok.pad_token == "<|endoftext|>" and cfg.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([encode_prompt(tok, "What is 2 + 3?")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_tiny_tokenizer_round_trips_and_splits_digits(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    text = "What is 12 + 7? The answer is 19."
    ids = encode_prompt(tok, text)
    assert tok.decode(ids) == text
    pieces = tok.convert_ids_to_tokens(ids)
    assert (
        "1" in pieces
        and "2" in pieces
        and "9" in pieces
        and not any(p.strip("Ġ").isdigit() and len(p.strip("Ġ")) > 1 for p in pieces)
    )
    for other in ["héllo wörld 🙂", "  two  spaces\n\ttab", "1234567890"]:
        assert tok.decode(tok.encode(other, add_special_tokens=False)) == other


def test_tiny_chat_template(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    text = render_prompt(tok, "What is 2 + 3?", apply_chat_template=True, system_prompt="Be brief.")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = encode_prompt(tok, text)
    # Special tokens are single ids and appear once each where the template put them (no extra BOS).
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids) == text
    # Plain text is untouched; messages are always templated; a system message in them wins.
    assert render_prompt(tok, "2 + 3 =", apply_chat_template=False) == "2 + 3 ="
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_prompt(tok, msgs, apply_chat_template=False, system_prompt="ignored").startswith(
        "<|im_start|>system\nS<|im_end|>"
    )
    with pytest.raises(UserError, match="system_prompt"):
        render_prompt(tok, "x", apply_chat_template=False, system_prompt="s")
    with pytest.raises(UserError, match="message 0"):
        render_prompt(tok, [{"role": "user"}], apply_chat_template=True)


def test_tiny_build_is_deterministic(tmp_path):
    a = build_tiny_llama(tmp_path / "a", seed=0)
    b = build_tiny_llama(tmp_path / "b", seed=0)
    c = build_tiny_llama(tmp_path / "c", seed=1)
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(a / f) == _sha(b / f), f
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    assert _sha(a / "tokenizer.json") == _sha(c / "tokenizer.json")  # the vocabulary does not follow the seed


# --- errors -----------------------------------------------------------------------------------------------


def test_unknown_zoo_name_lists_known_names(tmp_path):
    with pytest.raises(UserError) as e:
        resolve_checkpoint("llama-9000", cache_dir=tmp_path)
    msg = str(e.value)
    assert "llama-9000" in msg and all(name in msg for name in ZOO) and "\n" not in msg


def test_directory_without_config_is_user_error(tmp_path):
    d = tmp_path / "not_a_model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as e:
        resolve_checkpoint(str(d))
    assert str(d) in str(e.value) and "config.json" in str(e.value)
    with pytest.raises(UserError, match="no such model directory"):
        resolve_checkpoint(str(tmp_path / "missing"))


def test_existing_directory_is_accepted(tiny_dir):
    assert resolve_checkpoint(str(tiny_dir)) == tiny_dir


def test_concurrent_builder_uses_existing_result(tmp_path, monkeypatch):
    # Simulate losing the race: the final directory appears while this builder is still building.
    from sluiceway.models import zoo

    final = model_cache_dir("tiny-llama", tmp_path)
    entry = zoo.ZOO["tiny-llama"]

    def racing_build(out: Path) -> None:
        build_tiny_llama(final, seed=0)  # "the other process" finishes first
        build_tiny_llama(out, seed=0)

    monkeypatch.setitem(
        zoo.ZOO, "tiny-llama", zoo.ZooEntry(entry.name, entry.description, entry.recipe_version, racing_build)
    )
    assert resolve_checkpoint("tiny-llama", cache_dir=tmp_path) == final.resolve()
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    from sluiceway.models import zoo

    entry = zoo.ZOO["tiny-llama"]

    def crashing_build(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setitem(
        zoo.ZOO,
        "tiny-llama",
        zoo.ZooEntry(entry.name, entry.description, entry.recipe_version, crashing_build),
    )
    with pytest.raises(RuntimeError, match="boom"):
        resolve_checkpoint("tiny-llama", cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICEWAY_CACHE", str(tmp_path / "envcache"))
    assert model_cache_dir("tiny-llama").parent == tmp_path / "envcache" / "models"


# --- SmolLM2 ----------------------------------------------------------------------------------------------


def test_smollm2_converts_and_loads(smollm2_dir):
    t0 = time.perf_counter()
    tok = load_tokenizer(smollm2_dir)
    model = load_hf_model(smollm2_dir)
    print(f"\nsmollm2 load: {time.perf_counter() - t0:.1f}s")
    assert smollm2_dir.name == f"smollm2-135m-instruct-{ZOO['smollm2-135m-instruct'].recipe_version}"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"

    text = render_prompt(tok, "What is 2 + 3?", apply_chat_template=True)
    ids = encode_prompt(tok, text)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # default system + user + assistant
    inp = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inp.shape[1] :], skip_special_tokens=True)
    assert answer.strip()
