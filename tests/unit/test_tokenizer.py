"""The character tokenizer round-trips text exactly and loads back with AutoTokenizer offline; the
prompt and SFT encodings follow the chat template of whatever tokenizer they are given."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from stages.data.arithmetic import generate_arithmetic
from stages.data.examples import DataError, Example
from stages.data.tokenizer import R1_TAGS, build_char_tokenizer, encode_prompt, encode_sft
from tests.support.llama3 import EOT, build_llama3_tokenizer

EXAMPLES = generate_arithmetic(0, 50, "train")
PRINTABLE = string.printable[:95] + "\n"  # digits, letters, punctuation, space; then newline


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("char_tokenizer")
    build_char_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def char_tok(char_dir):
    # What every stage does: load the saved directory, offline.
    return AutoTokenizer.from_pretrained(char_dir, local_files_only=True)


@pytest.fixture(scope="module")
def llama_like_tok(tmp_path_factory):
    """A second tokenizer unlike ours: byte-level BPE with merges across characters and Llama 3's
    chat template, here with the end of turn as the eos (as Llama 3's instruct models have it)."""
    corpus = [e.prompt + e.response for e in EXAMPLES] * 4
    return build_llama3_tokenizer(tmp_path_factory.mktemp("llama_like"), corpus, eos_token=EOT)


def test_vocabulary_is_printable_ascii_newline_tags_and_specials_under_128(char_tok):
    vocab = char_tok.get_vocab()
    assert len(char_tok) == len(vocab) < 128
    assert set(PRINTABLE) | set(R1_TAGS) <= set(vocab)
    specials = {"<|pad|>", "<|eos|>", "<|unk|>", "<|user|>", "<|assistant|>"}
    assert set(vocab) == set(PRINTABLE) | set(R1_TAGS) | specials
    assert (char_tok.pad_token, char_tok.eos_token, char_tok.unk_token) == ("<|pad|>", "<|eos|>", "<|unk|>")
    assert len({char_tok.pad_token_id, char_tok.eos_token_id, char_tok.unk_token_id}) == 3


def test_saved_tokenizer_encodes_like_the_built_one(char_dir, char_tok):
    built = build_char_tokenizer(char_dir)
    for e in EXAMPLES[:5]:
        assert built(e.response)["input_ids"] == char_tok(e.response)["input_ids"]


@pytest.mark.parametrize("tag", R1_TAGS)
def test_each_tag_is_one_token_that_decodes_back(char_tok, tag):
    ids = char_tok(f"1{tag}2", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3 and char_tok.decode(ids) == f"1{tag}2"
    assert char_tok.decode(ids, skip_special_tokens=True) == f"1{tag}2", (
        "tags must survive skip_special_tokens"
    )


def test_arithmetic_examples_round_trip_exactly(char_tok):
    for e in EXAMPLES:
        for text in (e.prompt, e.response, e.prompt + "\n" + e.response):
            assert char_tok.decode(char_tok(text, add_special_tokens=False)["input_ids"]) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=PRINTABLE, max_size=60))
def test_printable_text_round_trips_one_token_a_character(char_tok, text):
    ids = char_tok(text, add_special_tokens=False)["input_ids"]
    assert char_tok.decode(ids) == text
    # Tags and special tokens written in the text are one token each, as in any HF tokenizer.
    if not any(token in text for token in char_tok.get_added_vocab()):
        assert len(ids) == len(text)


def test_characters_outside_the_vocabulary_become_unk(char_tok):
    ids = char_tok("a\tb\u00e9", add_special_tokens=False)["input_ids"]
    assert ids[1] == ids[3] == char_tok.unk_token_id and len(ids) == 4


def test_chat_template_marks_turns(char_tok):
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "<answer>2</answer>"}]
    assert (
        char_tok.apply_chat_template(chat, tokenize=False)
        == "<|user|>1+1=<|assistant|><answer>2</answer><|eos|>"
    )
    prompt = char_tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>1+1=<|assistant|>"


def test_encode_prompt_is_the_user_turn_then_the_assistant_marker(char_tok):
    ids = encode_prompt(char_tok, "0030+8494+5673=")
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == char_tok.convert_tokens_to_ids(["<|user|>", *"0030+8494+5673=", "<|assistant|>"])


def _check_sft_encoding(tok, example):
    ids, mask = encode_sft(tok, example)
    prompt = encode_prompt(tok, example.prompt)
    response = tok(example.response, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(mask)
    assert ids == prompt + response + [tok.eos_token_id]
    assert mask == [0] * len(prompt) + [1] * (len(response) + 1)
    learned = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(learned) == example.response + tok.eos_token


@pytest.mark.parametrize("example", EXAMPLES[:10], ids=lambda e: e.id)
def test_sft_loss_mask_covers_exactly_the_response_and_eos(char_tok, example):
    _check_sft_encoding(char_tok, example)
    ids, mask = encode_sft(char_tok, example)
    assert char_tok.decode(ids) == f"<|user|>{example.prompt}<|assistant|>{example.response}<|eos|>"


@pytest.mark.parametrize("example", EXAMPLES[:10], ids=lambda e: e.id)
def test_sft_encoding_follows_another_tokenizers_template(llama_like_tok, example):
    _check_sft_encoding(llama_like_tok, example)
    prompt = encode_prompt(llama_like_tok, example.prompt)
    assert llama_like_tok.decode(prompt) == (
        f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{example.prompt}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert len(llama_like_tok(example.response)["input_ids"]) < len(example.response), "BPE merges nothing"


def test_sft_refuses_an_example_without_response(char_tok):
    with pytest.raises(DataError, match="^q7: has no response"):
        encode_sft(char_tok, Example("q7", "1+1=", "2", None))
