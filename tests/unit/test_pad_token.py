"""A tokenizer without a pad token, as Llama 3's are: the test's Llama 3 style tokenizer has none and
loads offline; `load_tokenizer`, the one place every stage loads a tokenizer, gives it its eos and
says so; and padding with the eos changes neither the SFT loss mask nor what generation produces
nor where a response ends."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from stages.data.examples import read_examples
from stages.data.sft_batches import count_loss_tokens, micro_batches, tokenize_examples
from stages.data.tokenizer import build_char_tokenizer, encode_prompt, load_tokenizer
from stages.generation import generate_tokens
from stages.grpo.rollout import sequences
from tests.support.gsm8k_like import gsm8k_like, write_gsm8k_like
from tests.support.llama3 import BOS, EOS, EOT, SPECIAL_TOKENS, build_llama3_model_dir

NO_PAD = f"tokenizer has no pad token: padding with {EOS}"


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return read_examples(write_gsm8k_like(tmp_path_factory.mktemp("data") / "sft.jsonl", gsm8k_like(12)))


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory, examples):
    out = tmp_path_factory.mktemp("llama3")
    build_llama3_model_dir(out, [f"{ex.prompt}\n{ex.response}" for ex in examples])
    return out


def test_llama3_style_tokenizer_has_no_pad_token_and_loads_offline(llama3_dir):
    tok = AutoTokenizer.from_pretrained(llama3_dir, local_files_only=True)
    assert tok.pad_token is None and (tok.bos_token, tok.eos_token) == (BOS, EOS)
    assert len(tok) == AutoConfig.from_pretrained(llama3_dir).vocab_size, "the model covers every token"
    assert tok.convert_ids_to_tokens(list(range(len(tok) - len(SPECIAL_TOKENS), len(tok)))) == SPECIAL_TOKENS
    chat = [{"role": "user", "content": " 1+1? "}, {"role": "assistant", "content": "2"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        f"{BOS}<|start_header_id|>user<|end_header_id|>\n\n1+1?{EOT}"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n2{EOT}"
    )
    assert tok("pens")["input_ids"][0] == tok.bos_token_id
    assert tok.decode(tok.apply_chat_template(chat), skip_special_tokens=True) == "user\n\n1+1?assistant\n\n2"


def test_load_tokenizer_pads_with_the_eos_and_says_so(llama3_dir, caplog):
    with caplog.at_level(logging.INFO, logger="hpcr1.tokenizer"):
        tok = load_tokenizer(llama3_dir)
    assert (tok.pad_token, tok.pad_token_id) == (EOS, tok.eos_token_id)
    assert f"{NO_PAD} (id {tok.eos_token_id})" in caplog.messages


def test_a_tokenizer_with_a_pad_token_keeps_it_silently(tmp_path, caplog):
    build_char_tokenizer(tmp_path)
    with caplog.at_level(logging.INFO, logger="hpcr1.tokenizer"):
        tok = load_tokenizer(tmp_path)
    assert tok.pad_token == "<|pad|>" != tok.eos_token and not caplog.messages


def test_eos_padding_is_outside_the_sft_loss_mask(llama3_dir, examples):
    tok = load_tokenizer(llama3_dir)
    samples, _ = tokenize_examples(tok, examples, max_seq_len=512)
    assert len({len(s.input_ids) for s in samples}) > 1, "ragged, so rows are padded"
    batches = micro_batches(samples, tok.pad_token_id, micro_batch_size=4)
    for mb in batches:
        learned_eos = ((mb.labels == tok.eos_token_id) & (mb.loss_mask == 1)).sum(dim=1)
        assert learned_eos.tolist() == [1] * len(mb.labels), "each row learns its own eos, not the padding"
        lengths = (mb.loss_mask.flip(1).cumsum(1) > 0).sum(1)  # a row's labels up to its last response one
        assert all((mb.labels[row, n:] == tok.eos_token_id).all() for row, n in enumerate(lengths.tolist()))
    assert sum(mb.loss_mask.sum().item() for mb in batches) == count_loss_tokens(samples)


def test_eos_left_padding_changes_no_generated_token(llama3_dir, examples):
    tok = load_tokenizer(llama3_dir)
    model = AutoModelForCausalLM.from_pretrained(llama3_dir, dtype=torch.float32).eval()
    prompts = [encode_prompt(tok, text) for text in [ex.prompt for ex in examples[:3]] + ["How many pens?"]]
    assert len({len(p) for p in prompts}) > 1, "ragged, so rows are left-padded with the eos"
    input_ids, attention, batched = generate_tokens(model, tok, prompts, 16)
    assert (input_ids[attention == 0] == tok.eos_token_id).all() and (attention == 0).any()
    for row, prompt in zip(batched, prompts):
        alone = generate_tokens(model, tok, [prompt], 16)[2][0]
        assert torch.equal(row[: len(alone)], alone) and (row[len(alone) :] == tok.eos_token_id).all()


def test_a_response_ends_at_its_first_eos_not_in_the_eos_padding_after_it():
    eos = 7
    prompt, prompt_mask = torch.tensor([[eos, 3], [4, 5]]), torch.tensor([[0, 1], [1, 1]])
    responses = torch.tensor([[1, 2, eos, eos, eos], [1, eos, eos, eos, eos]])
    batch = sequences(prompt, prompt_mask, responses, eos)
    assert batch["response_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0]]
