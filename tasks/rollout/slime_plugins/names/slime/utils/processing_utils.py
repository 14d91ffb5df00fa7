"""slime.utils.processing_utils: load_tokenizer, load_processor, build_processor_kwargs, encode_image_for_rollout_engine
(slime's slime/utils/processing_utils.py).

Nothing is fetched from a model hub here: both loaders pass `local_files_only=True` unless the caller says otherwise,
so `name_or_path` must be a local model directory (or one already in the HF cache). Not here: process_vision_info
(Qwen-VL's image and video extraction) and slime's hand-built GLM-4.xV processor fallback.
"""

from __future__ import annotations

import base64
import io
import logging

logger = logging.getLogger(__name__)


def load_tokenizer(name_or_path: str, **kwargs):
    """AutoTokenizer.from_pretrained(name_or_path, **kwargs), not cached (slime's processing_utils.py:18)."""
    from transformers import AutoTokenizer

    kwargs.setdefault("local_files_only", True)
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs):
    """The model's multimodal processor, or None when it has none (HF gives back a plain tokenizer) or it does not
    load (OSError, ValueError). slime's processing_utils.py:85-97."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    kwargs.setdefault("local_files_only", True)
    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as e:
        logger.warning(f"Failed to load processor from {name_or_path}: {e}")
        return None
    if isinstance(processor, PreTrainedTokenizerBase) or not isinstance(processor, ProcessorMixin):
        return None
    return processor


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """The processor's call kwargs for `multimodal_inputs`: text as lists (`return_tensors=None`, no mm token type
    ids), every modality as torch tensors. slime's processing_utils.py:22-40."""
    kwargs = dict(multimodal_inputs) if multimodal_inputs else {}
    kwargs["text_kwargs"] = {**kwargs.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for modality in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        kwargs[modality] = {**kwargs.get(modality, {}), "return_tensors": "pt"}
    return kwargs


def encode_image_for_rollout_engine(image) -> str:
    """A PIL image as an RGB PNG data URI, SGLang's `image_data` form. slime's processing_utils.py:155."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("utf-8")
