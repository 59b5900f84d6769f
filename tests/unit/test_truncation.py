"""What an SFT stage's max_seq_len cuts is counted: examples truncated, tokens and response tokens
cut, examples left without a response token (left out: they would train nothing); a length that
leaves no response token anywhere is refused naming the field, one that truncates most examples
warned of."""

from __future__ import annotations

import pytest

from stages.data.examples import Example
from stages.data.sft_batches import Truncation, tokenize_examples
from stages.data.tokenizer import build_char_tokenizer

# With the character tokenizer, one token a character or tag, plus <|user|>, <|assistant|>, eos.
EXAMPLES = [
    Example("a", "1+1=", "2", "<think>ab</think><answer>2</answer>"),  # prompt 6 tokens, response 7+1
    Example("b", "12=", "12", "<answer>12</answer>"),  # prompt 5, response 4+1
    Example("c", "x" * 20, "2", "<think>ab</think><answer>2</answer>"),  # prompt 22, response 7+1
]
FIELD = "stage3_sft.max_seq_len"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char"))


def test_counts_what_max_seq_len_cuts_and_leaves_out_examples_without_response(tokenizer):
    # 9 inputs (10 tokens: the last is only a label): a loses 4 response tokens, b fits, c keeps only
    # 10 of its 22 prompt tokens.
    samples, cut = tokenize_examples(tokenizer, EXAMPLES, max_seq_len=9)
    assert cut == Truncation(
        max_seq_len=9,
        examples=3,
        truncated=2,
        tokens_cut=4 + 20,
        response_tokens_cut=4 + 8,
        left_out=1,
        longest_prompt=22,
        longest=30,
    )
    assert [s.loss_mask for s in samples] == [[0] * 6 + [1] * 4, [0] * 5 + [1] * 5]
    assert [len(s.input_ids) for s in samples] == [10, 10]
    assert cut.refusal(FIELD) is None


def test_nothing_is_cut_from_examples_that_fit(tokenizer):
    samples, cut = tokenize_examples(tokenizer, EXAMPLES, max_seq_len=29)
    assert (cut.truncated, cut.tokens_cut, cut.response_tokens_cut, cut.left_out) == (0, 0, 0, 0)
    assert [len(s.input_ids) for s in samples] == [14, 10, 30]
    assert cut.refusal(FIELD) is cut.warning(FIELD) is None


def test_one_response_token_within_max_seq_len_is_enough_to_train(tokenizer):
    # b's prompt is 5 tokens: max_seq_len 5 keeps its first response token as a label, 4 does not.
    _, cut = tokenize_examples(tokenizer, EXAMPLES[1:2], max_seq_len=5)
    assert cut.left_out == 0 and cut.refusal(FIELD) is None
    _, cut = tokenize_examples(tokenizer, EXAMPLES[1:2], max_seq_len=4)
    assert cut.left_out == 1 and cut.refusal(FIELD) is not None


def test_no_response_token_left_anywhere_is_refused_naming_the_field(tokenizer):
    samples, cut = tokenize_examples(tokenizer, EXAMPLES, max_seq_len=4)
    assert samples == [] and cut.left_out == cut.examples == 3
    assert cut.refusal(FIELD) == (
        "4 leaves no response token in any of the 3 examples (prompts up to 22 tokens, whole examples "
        "up to 30); raise stage3_sft.max_seq_len"
    )
    assert cut.warning(FIELD) is None, "a refusal, not a warning"


def test_truncating_most_examples_is_warned_of(tokenizer):
    _, most = tokenize_examples(tokenizer, EXAMPLES, max_seq_len=9)  # 2 of 3 truncated
    assert most.warning(FIELD) == (
        "2 of 3 examples are longer than stage3_sft.max_seq_len=9 and were truncated"
        ": 12 response tokens cut, 1 example(s) left without any (left out of training)"
    )
    _, few = tokenize_examples(tokenizer, EXAMPLES, max_seq_len=13)  # only c
    assert few.truncated == 1 and few.warning(FIELD) is None
