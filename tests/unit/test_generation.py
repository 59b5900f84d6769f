"""Our decode loop against Hugging Face `generate` and the model's own forward: greedy tokens
identical, per-step logits equal within fp32 tolerance, sampling that draws the same tokens as
`generate` (top_k=0) from the same seed and follows softmax(logits / T) after top-p, eos rows
padded with the loop stopping early, and the recorded log-probs and entropy of the drawn tokens
those of the model's own forward over each finished sequence."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from stages.data.tokenizer import build_char_tokenizer, encode_prompt
from stages.generation import (
    Decoder,
    EndedRows,
    TokenScores,
    decode,
    generate_responses,
    generate_tokens,
    left_padded,
    prefilled,
    read_layers,
)
from stages.models.tiny import build_tiny_llama
from tests.support.llama_configs import llama3_rope

VOCAB, PAD = 32, 0


def random_llama(seed: int = 0, heads: int = 4, kv_heads: int = 2, rope=None, logit_scale: float = 1.0):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=96,
        max_position_embeddings=128,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        pad_token_id=PAD,
        initializer_range=0.1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)  # sharper distributions, so a wrong temperature shows
            for norm in (m for m in model.modules() if isinstance(m, LlamaRMSNorm)):
                norm.weight.uniform_(0.5, 1.5)  # not HF's ones, so a norm that drops its weight shows
    return model


def ragged_prompts(batch: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (batch,), generator=gen)
    return [torch.randint(1, VOCAB, (int(n),), generator=gen).tolist() for n in lengths]


def hf_new_tokens(model, prompt_ids, max_new_tokens, eos_id, **sampling):
    input_ids, attention = left_padded(prompt_ids, PAD)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        pad_token_id=PAD,
        eos_token_id=eos_id,
        **(sampling or {"do_sample": False}),
    )
    return out[:, input_ids.shape[1] :]


def our_new_tokens(model, prompt_ids, max_new_tokens, eos_id, temperature=0.0, top_p=1.0):
    input_ids, attention = left_padded(prompt_ids, PAD)
    return decode(model, input_ids, attention, max_new_tokens, eos_id, PAD, temperature, top_p)


LLAMA3_ROPE = llama3_rope(16)


@pytest.mark.parametrize(
    "heads,kv_heads,rope",
    [(4, 4, None), (4, 2, None), (4, 1, LLAMA3_ROPE)],
    ids=["mha", "gqa", "mqa-llama3-rope"],
)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_tokens_equal_hf_generate(heads, kv_heads, rope, batch):
    model = random_llama(heads=heads, kv_heads=kv_heads, rope=rope)
    prompts = ragged_prompts(batch, seed=batch)
    expected = hf_new_tokens(model, prompts, 40, eos_id=VOCAB + 1)  # an id never drawn: full length
    assert torch.equal(our_new_tokens(model, prompts, 40, eos_id=VOCAB + 1), expected)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The embedded default's model shape and tokenizer, freshly initialised."""
    out = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer(out)
    build_tiny_llama(
        out,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), tokenizer


@pytest.mark.parametrize("batch", [1, 8, 50])
def test_tiny_model_greedy_equals_hf_generate_on_ragged_prompts(tiny, batch):
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, f"{i * 37 % 1000}+{i * 91 % 100000}=") for i in range(batch)]
    assert len({len(p) for p in prompts}) > (batch > 1)  # ragged, so rows are left-padded
    expected = hf_new_tokens(model, prompts, 16, tokenizer.eos_token_id)
    _, _, ours = generate_tokens(model, tokenizer, prompts, 16)
    assert torch.equal(ours, expected)


# bf16: HF's attention rounds in other places than ours (max error ~0.03 on logits of mean size
# ~0.7); a norm that lost its weight is off by ~3.6, one scaling in fp32 by ~0.07.
@pytest.mark.parametrize(
    "dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"]
)
def test_step_logits_match_hf_forward(dtype, tolerance):
    """Teacher-forced through the decoder's prefill and cached steps, the logits of every step equal
    those of one HF forward over the whole padded sequence, in the model's dtype."""
    model = random_llama(kv_heads=2).to(dtype)
    prompts = ragged_prompts(4, seed=7)
    input_ids, attention = left_padded(prompts, PAD)
    continuation = torch.randint(1, VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    full_mask = torch.cat([attention, torch.ones_like(continuation)], dim=1)
    positions = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        reference = model(
            input_ids=torch.cat([input_ids, continuation], dim=1),
            attention_mask=full_mask,
            position_ids=positions,
        ).logits[:, input_ids.shape[1] - 1 : -1]

    decoder = Decoder(model, input_ids, attention, max_new_tokens=10)
    with torch.no_grad():
        logits = [decoder.logits(decoder.prefill())]
        logits += [decoder.logits(decoder.step(continuation[:, t], t)) for t in range(9)]
    torch.testing.assert_close(torch.stack(logits, dim=1), reference.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.8)])
def test_sampling_draws_what_hf_generate_draws_from_the_same_seed(temperature, top_p):
    model = random_llama(logit_scale=5.0)
    prompts = ragged_prompts(6, seed=3)
    torch.manual_seed(11)
    ours = our_new_tokens(model, prompts, 30, VOCAB + 1, temperature, top_p)
    torch.manual_seed(11)
    again = our_new_tokens(model, prompts, 30, VOCAB + 1, temperature, top_p)
    torch.manual_seed(11)
    hf = hf_new_tokens(
        model, prompts, 30, VOCAB + 1, do_sample=True, temperature=temperature, top_p=top_p, top_k=0
    )
    assert torch.equal(ours, again)
    assert torch.equal(ours, hf)


def test_grouped_prompts_are_prefilled_once_and_draw_what_generate_draws(monkeypatch):
    """GRPO's batches hold each prompt G times in a row: each distinct prompt is prefilled once, and
    the rows still draw what `generate` draws from the same seed."""
    model = random_llama(logit_scale=5.0)
    prompts = [p for p in ragged_prompts(3, seed=5) for _ in range(4)]
    prefill_rows = []
    original = Decoder.prefill
    monkeypatch.setattr(
        Decoder, "prefill", lambda self: prefill_rows.append(len(self.input_ids)) or original(self)
    )
    torch.manual_seed(2)
    ours = our_new_tokens(model, prompts, 30, VOCAB + 1, temperature=0.7)
    torch.manual_seed(2)
    hf = hf_new_tokens(model, prompts, 30, VOCAB + 1, do_sample=True, temperature=0.7, top_k=0)
    assert prefill_rows == [3]
    assert torch.equal(ours, hf)
    input_ids, attention = left_padded(prompts, PAD)
    with torch.no_grad():
        _, hidden = prefilled(model, input_ids, attention, 30)
    assert all(torch.equal(hidden[i], hidden[i - i % 4]) for i in range(len(prompts)))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest most-likely set whose mass reaches top_p, renormalised (independent of HF's code)."""
    sorted_probs, order = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p  # mass before this token is short of top_p
    kept = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
    return kept / kept.sum()


def test_first_token_frequencies_follow_tempered_top_p_softmax():
    model = random_llama(logit_scale=4.0)
    prompt, rows, temperature, top_p = [5, 9, 2], 20000, 0.7, 0.9
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    expected = nucleus((logits / temperature).softmax(0), top_p)
    wrong_temperature = nucleus(logits.softmax(0), top_p)
    torch.manual_seed(0)
    drawn = our_new_tokens(model, [prompt] * rows, 1, VOCAB + 1, temperature, top_p)[:, 0]
    observed = torch.bincount(drawn, minlength=VOCAB).double() / rows
    distance = lambda p, q: 0.5 * (p.double() - q.double()).abs().sum().item()  # noqa: E731
    # 20000 draws over ~10 tokens: the total variation of sampling noise is ~0.01
    assert distance(observed, expected) < 0.02
    assert distance(expected, wrong_temperature) > 0.06
    assert observed[expected == 0].sum() == 0  # nothing outside the nucleus


def test_rows_that_end_early_are_padded_and_the_loop_stops():
    model = random_llama(seed=1)
    prompts = ragged_prompts(3, seed=5)
    free_run = our_new_tokens(model, prompts, 24, eos_id=VOCAB + 1)
    # eos: the token that every row emits soonest (its latest first appearance is the earliest)
    first_seen = {
        tok: max((row == tok).nonzero()[0].item() for row in free_run)
        for tok in range(VOCAB)
        if all((row == tok).any() for row in free_run)
    }
    assert first_seen, "no token common to all rows: pick other prompts"
    eos = min(first_seen, key=first_seen.get)
    assert first_seen[eos] < 23, "eos would only come at the last step: pick other prompts"
    ours = our_new_tokens(model, prompts, 24, eos_id=eos)
    assert torch.equal(ours, hf_new_tokens(model, prompts, 24, eos_id=eos))
    assert ours.shape[1] == first_seen[eos] + 1  # stopped once the last row ended
    for row, free in zip(ours, free_run):
        end = (row == eos).nonzero()[0].item()
        assert torch.equal(row[: end + 1], free[: end + 1])
        assert (row[end + 1 :] == PAD).all()


def test_generate_responses_decodes_only_new_tokens(tiny):
    model, tokenizer = tiny
    responses = generate_responses(model, tokenizer, ["12+34=", "5+6="], 5)
    expected = hf_new_tokens(
        model, [encode_prompt(tokenizer, p) for p in ("12+34=", "5+6=")], 5, tokenizer.eos_token_id
    )
    assert responses == tokenizer.batch_decode(expected, skip_special_tokens=True)


def test_length_dependent_rope_is_refused():
    model = random_llama(rope={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type is 'dynamic'"):
        our_new_tokens(model, [[1, 2]], 3, eos_id=1)


def test_sampled_rows_that_end_leave_the_batch_and_the_others_still_draw_what_generate_draws(monkeypatch):
    model = random_llama(seed=2)
    prompts = ragged_prompts(16, seed=7)
    torch.manual_seed(5)
    free_run = our_new_tokens(model, prompts, 40, VOCAB + 1, temperature=1.0)

    # The RNG is consumed alike whatever eos is, so the free run shows where each row would end:
    # take the token that most rows draw within 20 steps.
    def first_step(row, tok):
        found = (row == tok).nonzero()
        return found[0].item() if len(found) else 40

    ends = {tok: sorted(first_step(row, tok) for row in free_run) for tok in range(1, VOCAB)}
    eos = max(ends, key=lambda tok: sum(step < 20 for step in ends[tok]))
    assert ends[eos][8] < 20 and ends[eos][-1] > ends[eos][8] + 3, (
        "half the rows must end well before the rest"
    )
    kept_sizes = []
    keep = Decoder.keep
    monkeypatch.setattr(
        Decoder, "keep", lambda self, rows: (kept_sizes.append(len(rows)), keep(self, rows))[1]
    )
    torch.manual_seed(5)
    ours = our_new_tokens(model, prompts, 40, eos, temperature=1.0)
    torch.manual_seed(5)
    hf = hf_new_tokens(model, prompts, 40, eos, do_sample=True, temperature=1.0, top_k=0)
    assert kept_sizes and kept_sizes[-1] < 16, "the decoder never dropped the rows that had ended"
    assert torch.equal(ours, hf)


def test_recorded_log_probs_and_entropy_are_the_forward_pass_values_of_each_finished_sequence():
    """What the rollout hands the GRPO loss as old log-probs: for every token up to a row's eos, the
    tempered (untruncated: top-p only narrows the draw) log-softmax of HF's forward over that row's
    prompt and response alone, and the entropy of that distribution; recording draws nothing."""
    model = random_llama(seed=2, logit_scale=3.0)
    prompts, eos, temperature = ragged_prompts(12, seed=7), 2, 0.7
    input_ids, attention = left_padded(prompts, PAD)
    scores = TokenScores(len(prompts), 30, temperature, torch.device("cpu"))
    torch.manual_seed(4)
    tokens = decode(model, input_ids, attention, 30, eos, PAD, temperature, 0.9, scores)
    torch.manual_seed(4)
    assert torch.equal(tokens, decode(model, input_ids, attention, 30, eos, PAD, temperature, 0.9))
    ended = [(row == eos).nonzero() for row in tokens]
    assert sum(len(e) > 0 for e in ended) >= 6, "too few rows end: pick another eos"
    for row, (prompt, end) in enumerate(zip(prompts, ended)):
        length = end[0].item() + 1 if len(end) else tokens.shape[1]
        response = tokens[row, :length]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response.tolist()])).logits[0, len(prompt) - 1 : -1]
        log_p = (logits / temperature).log_softmax(-1)
        torch.testing.assert_close(
            scores.log_probs[row, :length], log_p.gather(1, response[:, None])[:, 0], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            scores.entropy[row, :length], -(log_p.exp() * log_p).sum(-1), rtol=1e-5, atol=1e-5
        )


def test_recording_log_probs_of_greedy_decoding_is_refused():
    with pytest.raises(ValueError, match="temperature > 0"):
        TokenScores(2, 4, 0.0, torch.device("cpu"))


def test_scores_of_another_temperature_than_the_sampling_are_refused():
    model = random_llama(seed=2)
    input_ids, attention = left_padded(ragged_prompts(2, seed=7), PAD)
    with pytest.raises(ValueError, match="temperature 0.7, the sampling's is 1.0"):
        decode(model, input_ids, attention, 4, 2, PAD, 1.0, 1.0, TokenScores(2, 4, 0.7, torch.device("cpu")))


# Ops after which the host must wait for a GPU: they read a device value (item, bool, nonzero,
# boolean indexing, unique, multinomial's validity check) or copy to the host without non_blocking
# (on the CPU no copy is one: the count shows what would wait, the device is the host).
READS_DEVICE = {
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::masked_select",
    "aten::multinomial",
    "aten::equal",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
}


class HostWaits(TorchDispatchMode):
    """Counts the ops that make the host wait for the device (CUDA's sync debug mode, on any device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        bool_index = name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        to_host = name == "aten::copy_" and args[0].device.type == "cpu" != args[1].device.type
        blocking_copy = to_host and not kwargs.get("non_blocking", args[2:3] == (True,))
        self.count += name in READS_DEVICE or bool_index or blocking_copy
        return func(*args, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_decode_loop_does_not_wait_for_the_device_at_each_token(temperature):
    """Against GPU stalls: the host-device waits of a call do not grow with the tokens it decodes
    (rows end at varied steps, so the ended rows are dropped along the way too)."""
    model = random_llama(seed=2)
    input_ids, attention = left_padded(ragged_prompts(16, seed=7), PAD)

    def waits(max_new_tokens):
        torch.manual_seed(5)
        # sampled as the rollout samples: recording each token's log-prob and entropy
        scores = TokenScores(16, max_new_tokens, temperature, torch.device("cpu")) if temperature else None
        with HostWaits() as counter:
            tokens = decode(model, input_ids, attention, max_new_tokens, 2, PAD, temperature, 0.9, scores)
        return counter.count, tokens

    few, short = waits(4)
    many, long = waits(40)
    assert long.shape[1] > 20 and (long == 2).any(dim=1).sum() >= 4, "rows should end along the way"
    assert torch.equal(long[:, :4], short)
    assert many == few


def test_generate_calls_copy_no_weights_and_read_what_load_weights_wrote():
    """The fused q/k/v and gate/up weights are the module's parameters themselves: the same memory
    on every call, so a rollout's `load_weights` (in-place copies) changes what the next call
    generates exactly as it changes HF's forward."""
    model, other = random_llama(seed=0), random_llama(seed=3)
    prompts = ragged_prompts(4, seed=1)
    ours_before = our_new_tokens(model, prompts, 20, eos_id=VOCAB + 1)
    first, second = read_layers(model), read_layers(model)
    for layer, a, b in zip(model.model.layers, first, second):
        assert a.qkv.data_ptr() == b.qkv.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert a.gate_up.data_ptr() == b.gate_up.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
        torch.testing.assert_close(
            a.qkv[-len(layer.self_attn.v_proj.weight) :], layer.self_attn.v_proj.weight
        )
    with torch.no_grad():  # what Rollout.load_weights does
        for name, param in model.named_parameters():
            param.copy_(other.get_parameter(name))
    ours_after = our_new_tokens(model, prompts, 20, eos_id=VOCAB + 1)
    assert not torch.equal(ours_after, ours_before)
    assert torch.equal(ours_after, hf_new_tokens(other, prompts, 20, eos_id=VOCAB + 1))
    assert read_layers(model)[0].qkv.data_ptr() == first[0].qkv.data_ptr()


class LateMarker:
    """A copy that lands on the host only at the third look, as a GPU's would while the host runs
    ahead of it."""

    def __init__(self):
        self.looks = 0

    def query(self) -> bool:
        self.looks += 1
        return self.looks >= 3

    def synchronize(self) -> None:
        self.looks = 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_host_that_learns_late_of_ended_rows_returns_the_same_tokens_and_rng_state(
    monkeypatch, temperature
):
    """A GPU's host learns a step's finished rows some steps later, decodes on meanwhile and drops
    ended rows late: the tokens, their width and where the RNG is left (where `generate` leaves it)
    are those of a host that learns at once."""
    model = random_llama(seed=1)
    input_ids, attention = left_padded(ragged_prompts(3, seed=5), PAD)

    def run(eos):
        torch.manual_seed(5)
        tokens = decode(model, input_ids, attention, 40, eos, PAD, temperature)
        return tokens, torch.rand(4)

    # eos: the token every row has drawn soonest (the RNG is consumed alike whatever eos is)
    free_run = run(VOCAB + 1)[0]
    last_first = {
        tok: max((row == tok).nonzero()[0].item() for row in free_run)
        for tok in range(1, VOCAB)
        if all((row == tok).any() for row in free_run)
    }
    eos = min(last_first, key=last_first.get)
    at_once = run(eos)
    steps = []
    step = Decoder.step
    monkeypatch.setattr(Decoder, "step", lambda self, token, t: steps.append(t) or step(self, token, t))
    original_init = EndedRows.__init__

    def late(self, *args):
        original_init(self, *args)
        self.immediate = False

    monkeypatch.setattr(EndedRows, "__init__", late)
    monkeypatch.setattr(EndedRows, "landed_marker", lambda self: LateMarker())
    late_tokens, late_rng = run(eos)
    assert at_once[0].shape[1] < 40, "every row should end before the last step"
    assert max(steps) >= at_once[0].shape[1], "the late host should have decoded past the end"
    assert torch.equal(late_tokens, at_once[0])
    assert torch.equal(late_rng, at_once[1])
