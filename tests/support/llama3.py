"""A Llama-3-style tokenizer built locally (no hub): byte-level BPE trained on a small corpus, Llama
3's special tokens laid out as Llama 3's are (after the merged vocabulary, reserved ones between the
named), a bos added by the post-processor, Llama 3's chat template, and no pad token, as the real
Llama 3 tokenizers have none. Saved as a Hugging Face directory that AutoTokenizer loads offline,
alone or with a small randomly initialised Llama of its vocabulary (`model.source: hf`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from stages.models.tiny import build_tiny_llama

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# Llama 3's first ten special tokens (ids 128000-128009 there), in its order.
SPECIAL_TOKENS = [
    BOS,
    EOS,
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    EOT,
]
# Each message is a header, a blank line, the trimmed content and <|eot_id|>; bos opens the chat.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def build_llama3_tokenizer(
    out_dir, corpus: Iterable[str], merges_vocab: int = 400, eos_token: str = EOS
) -> PreTrainedTokenizerFast:
    """Train on `corpus` (a vocabulary of `merges_vocab` byte-level tokens and merges), then append
    the special tokens. `eos_token`: <|end_of_text|> as in the base models, <|eot_id|> as in the
    instruct ones."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=merges_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    core.train_from_iterator(corpus, trainer)
    core.add_special_tokens(SPECIAL_TOKENS)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, core.token_to_id(BOS))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=eos_token, chat_template=CHAT_TEMPLATE
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_llama3_model_dir(out_dir, corpus: Iterable[str], seed: int = 0) -> PreTrainedTokenizerFast:
    """The tokenizer and a 2-layer Llama (GQA, Llama 3's RoPE base) whose vocabulary is exactly the
    tokenizer's, as in Llama 3, with random weights: config.json and model.safetensors."""
    tokenizer = build_llama3_tokenizer(out_dir, corpus)
    build_tiny_llama(
        out_dir,
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=128,
        rope_theta=500000.0,
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer
