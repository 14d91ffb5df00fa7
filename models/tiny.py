"""A tiny Llama-shaped model with a real tokenizer, built locally in a few seconds.

It exists so that tests, examples and CI exercise the whole stack (tokenizer, chat template, HF loading,
Megatron mapping, rollout engine, training) without the 540 MB SmolLM2 checkpoint. Its weights are random:
it is not meant to answer anything, only to have every shape and special token a real model has.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from sluiceway.models.chat import make_tokenizer_config_portable

# Bumped whenever the corpus, tokenizer settings or model shape change, so zoo caches rebuild.
RECIPE_VERSION = "v1"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2 (the trainer adds them first, in this order)

VOCAB_SIZE = 1024
# The corpus has a seed of its own: the tokenizer is part of the recipe and must not change with the
# weight seed, so checkpoints built with different seeds share one vocabulary.
_CORPUS_SEED = 1234

# ChatML, as SmolLM2 renders it, but without SmolLM2's default system message (the tiny model has no
# persona; a system message appears only when the caller gives one).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we say her she
or an will my one all would there their what so up out if about who get which go me when make can like time
no just him know take people into year your good some could them see other than then now look only come its
over think also back after use two how our work first well way even new want because any these give day most
us is are was were has had been number numbers sum add plus minus times equals answer question result total
count left right more less many much each every small large big zero one two three four five six seven eight
nine ten eleven twelve twenty hundred thousand first second third last next before apple apples orange book
books cat cats dog dogs tree trees house car cars box boxes coin coins friend friends teacher student class
school water food bread milk tea cup cups table chair room door window city road bird birds fish sun moon star
red blue green yellow black white happy sad fast slow hot cold old young long short please thank thanks hello
hi yes sure okay help helpful assistant user system model think step solve problem check correct wrong true
false because therefore so then has buys sells gives gets keeps loses finds eats reads writes walks runs
""".split()  # noqa: SIM905 (a word list reads better as prose)

_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Tom", "Anna", "Sam", "Lily", "Max"]
_OBJECTS = ["apples", "books", "coins", "cups", "birds", "boxes", "cars", "pens", "cookies", "marbles"]
_SYSTEMS = [
    "You are a helpful assistant.",
    "You are a careful math tutor. Give the final answer as a number.",
    "Answer briefly.",
]


def _corpus(rng: random.Random) -> list[str]:
    """Generated text covering what the tiny model will see: words, digits, arithmetic, ChatML turns."""
    lines: list[str] = []
    for _ in range(1500):
        n = rng.randint(4, 14)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", "."]))
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    for _ in range(3000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        sym, fn = rng.choice(ops)
        c = fn(a, b)
        lines.append(f"What is {a} {sym} {b}? The answer is {c}.")
        lines.append(f"{a} {sym} {b} = {c}")
    for _ in range(500):
        name, obj = rng.choice(_NAMES), rng.choice(_OBJECTS)
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        lines.append(f"{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?")
        lines.append(f"{name} has {a} + {b} = {a + b} {obj}. The answer is {a + b}.")
    # Chat turns as the template lays them out, minus the special tokens themselves (those are added
    # whole and never split, so the BPE only needs the text between them: role names and newlines).
    for _ in range(500):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        parts = []
        if rng.random() < 0.5:
            parts.append(f"system\n{rng.choice(_SYSTEMS)}\n")
        parts.append(f"user\nWhat is {a} + {b}?\n")
        parts.append(f"assistant\n{rng.choice(['', 'Sure! ', 'Let me think. '])}The answer is {a + b}.\n")
        lines.append("".join(parts))
    return lines


def train_tiny_tokenizer():
    """Train the byte-level BPE (deterministic: fixed corpus, fixed order, single ordered trainer input).

    Returns a `transformers.PreTrainedTokenizerFast` with ChatML special tokens and chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    # Digits are split off one by one before the byte-level split, so numbers never merge into
    # multi-digit tokens: "19" is always "1","9", which keeps arithmetic answers learnable and exact.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # No BOS/EOS post-processing: like SmolLM2, special tokens come from the chat template, never twice.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # The full byte alphabet, so any text (other scripts, emoji) still encodes and round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(_CORPUS_SEED)), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        # Decoding must give back exactly what was encoded (token-in, token-out; rewards parse the text).
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-init Llama (config, safetensors, generation config, tokenizer) into `out_dir`.

    Same seed -> byte-identical `model.safetensors`. Takes a few seconds on a CPU.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer()

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    make_tokenizer_config_portable(out)
    # A note of what built it, for humans and for the zoo's cache key.
    (out / "sluiceway_recipe.json").write_text(
        json.dumps({"recipe": "tiny-llama", "version": RECIPE_VERSION, "seed": seed}, indent=2) + "\n"
    )
    return out
