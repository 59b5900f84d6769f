"""A character-level tokenizer built locally with `tokenizers` (no hub), and the two encodings every
stage uses — which work for any Hugging Face tokenizer with a chat template (a real Llama 3 too).

Every printable ASCII character and newline is one token; the R1 tags are single tokens, so the
tiny model sees "<think>" as one symbol; the chat template marks turns with <|user|>/<|assistant|>.
"""
from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
SPECIALS = {"pad_token": "<|pad|>", "eos_token": "<|eos|>", "unk_token": "<|unk|>"}
TURN_MARKERS = ("<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer(out_dir) -> PreTrainedTokenizerFast:
    chars = [c for c in string.printable if c.isprintable() or c == "\n"]
    vocab = {tok: i for i, tok in enumerate([*SPECIALS.values(), *TURN_MARKERS, *dict.fromkeys(chars)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character alone
    core.decoder = decoders.Fuse()  # join characters back without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **SPECIALS, chat_template=CHAT_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": list(TURN_MARKERS)})
    tok.add_tokens(list(R1_TAGS))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_sft(tokenizer, example) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): the prompt as the chat template renders it, then the response's own
    tokens and eos; the mask is 1 exactly on the response and eos (the tokens the model must learn)."""
    prompt = encode_prompt(tokenizer, example.prompt)
    response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + response, [0] * len(prompt) + [1] * len(response)
