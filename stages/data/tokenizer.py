"""A character-level tokenizer built locally with `tokenizers` (no hub); how every stage loads a
tokenizer (`load_tokenizer`: one with no pad token gets one); and the two encodings every stage
uses, which work for any Hugging Face tokenizer with a chat template (a real Llama 3 too).

Every printable ASCII character and newline is one token (anything else becomes <|unk|>); the R1
tags are single tokens, so the tiny model sees "<think>" as one symbol; the chat template marks
turns with <|user|> and <|assistant|> and ends the assistant's with <|eos|>.
"""

from __future__ import annotations

import logging
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from stages.data.examples import DataError, Example
from stages.rewards.math_reward import R1_TAGS

SPECIALS = {"pad_token": "<|pad|>", "eos_token": "<|eos|>", "unk_token": "<|unk|>"}
TURN_MARKERS = ("<|user|>", "<|assistant|>")
CHARACTERS = [c for c in string.printable if c.isprintable()] + ["\n"]  # space..~ and newline
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>"
    "{% else %}{{ raise_exception('only user and assistant messages are supported') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer(out_dir) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate([*SPECIALS.values(), *TURN_MARKERS, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character alone
    core.decoder = decoders.Fuse()  # join the characters back without spaces between them
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, **SPECIALS, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False
    )  # " ." must decode as " ."
    tok.add_special_tokens({"additional_special_tokens": list(TURN_MARKERS)})
    tok.add_tokens(list(R1_TAGS))  # not special: decoding keeps them
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok


def load_tokenizer(model_dir):
    """The tokenizer of a model directory, with a pad token: the one place a tokenizer without one
    (Llama 3's) is given one, and says which. Nothing reads the pad's id to find padding: attention
    and loss masks come from the sequences' lengths, and a response ends at its first eos, so an eos
    in the padding after it is never the response's own."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {model_dir} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token  # as verl's trainer pads (engine verl): both engines alike
        logging.getLogger("hpcr1.tokenizer").info(
            "tokenizer has no pad token: padding with %s (id %d)", tokenizer.pad_token, tokenizer.pad_token_id
        )
    return tokenizer


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt as the chat template renders a user turn, ready for the assistant's reply."""
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def encode_sft(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): the encoded prompt, then the response's own tokens and eos; the mask
    is 1 exactly on the response and eos, the tokens the model must learn to produce. The response
    is tokenised alone, as the model will generate it after the prompt, not re-tokenised together
    with the rendered prompt (where a BPE merge could cross the boundary)."""
    if example.response is None:
        raise DataError(example.id, None, "has no response; SFT needs a worked solution for every example")
    prompt = encode_prompt(tokenizer, example.prompt)
    response = list(tokenizer(example.response, add_special_tokens=False)["input_ids"]) + [
        tokenizer.eos_token_id
    ]
    return prompt + response, [0] * len(prompt) + [1] * len(response)
