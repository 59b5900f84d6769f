"""Batched generation for Hugging Face Llama modules: prompts left-padded into one batch, prefilled
once, then decoded one token a step into a preallocated KV cache; responses decoded from the new
tokens only.

Our own loop rather than HF `generate`, which on the embedded default's tiny model spends much of
its time on work per token that is not the model's arithmetic (bench/generation_vs_hf.py has the
profile and the ratio). The loop reads the module's weights at every call (so the rollout's
`load_weights` applies) and its rotary embedding (so every static RoPE type, Llama 3's included, is
the module's own), and samples like HF: logits in fp32, divided by the temperature, then top-p
(nucleus, at least one token kept), one `torch.multinomial` draw per row and step from the global
torch RNG, so the same seed draws the same tokens as `generate` with `top_k=0`. No top-k:
`generate`'s default of 50 was never asked for, and the GRPO loss's log-probs are those of the
untruncated tempered softmax.

Nothing in the per-token loop waits for the device: the draw is `torch.multinomial`'s own algorithm
without its validity check's `.item()` (the check is kept on the device and read once a call), and
the host learns which rows have ended from non-blocking copies of the finished mask, read once they
have landed (at once on the CPU; a step or two late on a GPU, whose extra draws are then rewound so
the RNG ends where `generate` leaves it). The q/k/v and gate/up weights are fused once a model: their
parameters become views of one buffer (see `fused`), so a call copies no weights and `load_weights`
writes straight into what the next call reads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from stages.data.tokenizer import encode_prompt

# RoPE types whose frequencies change with the sequence length: HF recomputes them as the sequence
# grows, this loop computes the table once, so it would differ from the module.
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


def left_padded(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    return input_ids, attention


@dataclass
class Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused so that each is one matmul: views
    of the module's parameters, not copies (see `fused`)."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _consecutive(tensors: list[torch.Tensor]) -> bool:
    """Contiguous, of one dtype, one after the other in one storage: one view spans them all."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not (
            t.is_contiguous()
            and t.dtype == first.dtype
            and t.untyped_storage().data_ptr() == storage
            and t.storage_offset() == offset
        ):
            return False
        offset += t.numel()
    return True


def fused(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters concatenated along dim 0, as a view. The first call copies them into one
    buffer and points each parameter's `.data` at its rows of it: from then on a write to the
    parameters (the rollout's `load_weights`, an optimizer step) is a write to the fused tensor, and
    later calls find them consecutive and copy nothing. A module moved or reloaded since is fused
    anew, once."""
    if not _consecutive([p.data for p in params]):
        buffer, start = torch.cat([p.data for p in params]), 0
        for p in params:
            p.data, start = buffer[start : start + len(p)], start + len(p)
    first = params[0].detach()
    rows = sum(len(p) for p in params)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _fused_bias(*linears) -> torch.Tensor | None:
    return None if linears[0].bias is None else fused([m.bias for m in linears])


def read_layers(model) -> list[Layer]:
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            Layer(
                attn_norm=layer.input_layernorm.weight,
                qkv=fused([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                qkv_bias=_fused_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                out=attn.o_proj.weight,
                out_bias=attn.o_proj.bias,
                mlp_norm=layer.post_attention_layernorm.weight,
                gate_up=fused([mlp.gate_proj.weight, mlp.up_proj.weight]),
                gate_up_bias=_fused_bias(mlp.gate_proj, mlp.up_proj),
                down=mlp.down_proj.weight,
                down_bias=mlp.down_proj.bias,
            )
        )
    return layers


def check_supported(model) -> None:
    config = model.config
    if config.model_type != "llama":
        raise ValueError(f"generation supports Llama models; this one is model_type={config.model_type!r}")
    if config.hidden_act != "silu":
        raise ValueError(f"generation supports hidden_act 'silu'; this model has {config.hidden_act!r}")
    rope_type = model.model.rotary_emb.rope_type
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"generation supports static RoPE types; this model's rope_type is {rope_type!r}")


class Decoder:
    """The forward passes of one generate call over left-padded prompts [b, prompt_len]: `prefill`,
    then `step` once a new token, on a KV cache of keys [layers, b, kv_heads, head_dim, max_len] and
    values [layers, b, kv_heads, max_len, head_dim], max_len = prompt_len + max_new_tokens. Both
    return the last position's hidden state."""

    def __init__(self, model, input_ids: torch.Tensor, attention: torch.Tensor, max_new_tokens: int):
        check_supported(model)
        config, weight, device = model.config, model.lm_head.weight, input_ids.device
        self.layers, self.embed = read_layers(model), model.model.embed_tokens.weight
        self.final_norm, self.lm_head = model.model.norm.weight, weight
        self.eps, self.hidden = config.rms_norm_eps, config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.input_ids = input_ids
        (b, self.prompt_len), max_len = input_ids.shape, input_ids.shape[1] + max_new_tokens
        # Laid out for the decode step's batched matmuls: a layer's keys up to any length are one
        # [b * kv_heads, head_dim, length] view (transposed: the matmul reads them as they lie,
        # faster than from [.., length, head_dim]), its values one [b * kv_heads, length, head_dim].
        shape = (len(self.layers), b, self.kv_heads)
        self.keys = torch.empty(*shape, self.head_dim, max_len, dtype=weight.dtype, device=device)
        self.values = torch.empty(*shape, max_len, self.head_dim, dtype=weight.dtype, device=device)
        # added to the attention scores: -inf on the prompts' pads (a float mask: sdpa converts a
        # boolean one at every call)
        self.key_bias = torch.zeros(b, max_len, dtype=weight.dtype, device=device)
        self.key_bias[:, : self.prompt_len].masked_fill_(attention == 0, float("-inf"))
        # positions count real tokens only, as HF counts them for left-padded prompts
        prompt_positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        steps = torch.arange(1, max_new_tokens + 1, device=device)
        positions = torch.cat([prompt_positions, prompt_positions[:, -1:] + steps], dim=1)
        cos, sin = model.model.rotary_emb(self.embed[:1], positions)  # the module's own RoPE, any static type
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): the sign goes into the table once
        half = self.head_dim // 2
        self.cos, self.sin = (
            cos.unsqueeze(2),
            torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2),
        )

    def prefill(self) -> torch.Tensor:
        """Causal attention over the prompts; a pad position attends to itself only, so no row of
        the softmax is empty, and no real position attends to a pad."""
        n, device = self.prompt_len, self.input_ids.device
        future = torch.ones(n, n, dtype=torch.bool, device=device).triu(diagonal=1)
        mask = self.key_bias[:, None, None, :n].expand(-1, 1, n, n).clone()
        mask.diagonal(dim1=-2, dim2=-1).zero_()
        mask.masked_fill_(future, float("-inf"))

        def attend(q, keys, values):
            b, s = q.shape[:2]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(2, 3), values, attn_mask=mask, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(b, s, -1)

        return self.forward(self.input_ids, 0, attend)

    def step(self, token: torch.Tensor, t: int) -> torch.Tensor:
        """New token t [b] in; one query per row against the cache. The query heads that share a
        key/value head are read as that head's queries, so the cache is used as it lies: two batched
        matmuls over [b * kv_heads] (sdpa's CPU kernel is several times slower on these shapes)."""
        length, b, nkv = self.prompt_len + t + 1, token.shape[0], self.kv_heads
        bias = self.key_bias[:, None, :length].repeat_interleave(nkv, dim=0)  # [b * kv_heads, 1, length]

        def attend(q, keys, values):
            # scaled first: the product is contiguous, so the grouping is a view, not a copy
            grouped = (q * self.head_dim**-0.5).view(b * nkv, -1, self.head_dim)
            scores = torch.baddbmm(bias, grouped, keys.flatten(0, 1))
            return torch.bmm(scores.softmax(dim=-1), values.flatten(0, 1)).reshape(b, 1, -1)

        return self.forward(token[:, None], self.prompt_len + t, attend)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm: normalised in fp32, scaled in the model's dtype (for an fp32 model, one
        call: the same products as HF's, without the no-op casts and a separate multiply)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden,), weight, self.eps)
        return weight * F.rms_norm(x.float(), (self.hidden,), eps=self.eps).to(x.dtype)

    def forward(self, tokens: torch.Tensor, start: int, attend) -> torch.Tensor:
        """tokens [b, s] at cache positions start..start + s; `attend(q, keys, values)` ->
        [b, s, heads * head_dim] reads the cache up to start + s (keys [b, kv_heads, head_dim, length],
        values [b, kv_heads, length, head_dim])."""
        b, s = tokens.shape
        nq, nkv, stop, half = self.heads, self.kv_heads, start + s, self.head_dim // 2
        cos, sin = self.cos[:, start:stop], self.sin[:, start:stop]
        x = F.embedding(tokens.reshape(b * s), self.embed)  # [b * s, hidden]: 2-D matmuls, no reshapes
        for i, w in enumerate(self.layers):
            qkv = F.linear(self.norm(x, w.attn_norm), w.qkv, w.qkv_bias).view(
                b, s, nq + 2 * nkv, self.head_dim
            )
            qk = qkv[:, :, : nq + nkv]  # queries and keys rotated together, one RoPE
            qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
            keys, values = self.keys[i], self.values[i]
            keys[..., start:stop] = qk[:, :, nq:].permute(0, 2, 3, 1)
            values[:, :, start:stop] = qkv[:, :, nq + nkv :].transpose(1, 2)
            attended = attend(qk[:, :, :nq], keys[..., :stop], values[:, :, :stop])
            x = x + F.linear(attended.reshape(b * s, -1), w.out, w.out_bias)
            gate, up = F.linear(self.norm(x, w.mlp_norm), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        return self.norm(x.view(b, s, -1)[:, -1], self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    def keep(self, rows: torch.Tensor) -> None:
        """Go on with these rows only (indices into the current ones, repeats allowed): rows that
        have ended stop costing matmuls and attention."""
        self.keys, self.values, self.key_bias = self.keys[:, rows], self.values[:, rows], self.key_bias[rows]
        self.cos, self.sin = self.cos[rows], self.sin[rows]


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's TopPLogitsWarper: drop the least likely tokens whose total probability is at most
    1 - top_p, always keeping the most likely one."""
    sorted_scores, order = torch.sort(scores, descending=False)
    drop_sorted = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    drop_sorted[..., -1:] = False
    return scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))


def multinomial_draw(probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One token a row [b] from probs [b, vocab]: `torch.multinomial(probs, 1)`'s own algorithm
    (exponential noise, the argmax of probs / noise), so the same RNG state draws the same tokens,
    without its validity check's `.item()`: that check is and-ed into `valid`, read once a call."""
    valid &= (probs.max() < float("inf")) & (probs.min() >= 0)
    noise = torch.empty_like(probs).exponential_(1)
    return probs.div_(noise).argmax(dim=-1)


def next_tokens(
    scores: torch.Tensor,
    rows: torch.Tensor,
    batch: int,
    pad_id: int,
    sample: bool,
    top_p: float,
    valid: torch.Tensor,
) -> torch.Tensor:
    """The next token of every row of the batch [batch], from the tempered logits of the rows still
    decoding [len(rows), vocab] (the raw logits when greedy); the others get pad_id. Sampling draws
    for the whole batch, as `generate` does (one multinomial draw consumes the RNG by the batch's
    size, not by the values), so leaving ended rows out of the forward does not change what the
    others draw."""
    tokens = torch.full((batch,), pad_id, dtype=torch.long, device=scores.device)
    if not sample:
        tokens[rows] = scores.argmax(dim=-1)
        return tokens
    if top_p < 1.0:
        scores = top_p_filter(scores, top_p)
    probs = torch.zeros(batch, scores.shape[1], dtype=scores.dtype, device=scores.device)
    probs[:, pad_id] = 1.0
    probs[rows] = scores.softmax(dim=-1)
    return multinomial_draw(probs, valid)


class EndedRows:
    """Which rows have ended, as the host learns it without waiting for the device: each step's
    finished mask is copied, non-blocking, into host memory and read once its copy has landed. On
    the CPU that is at once; on a GPU the host runs ahead and learns of step t a few steps later."""

    def __init__(self, batch: int, max_new_tokens: int, device: torch.device):
        self.device, self.immediate = device, device.type == "cpu"
        # pinned where a GPU can copy into it asynchronously (pageable memory would make it wait)
        self.host = torch.zeros(max_new_tokens, batch, dtype=torch.bool, pin_memory=device.type == "cuda")
        self.in_flight: deque[tuple[int, torch.Event]] = deque()
        self.step = -1  # the latest step whose mask the host has

    def send(self, t: int, finished: torch.Tensor) -> None:
        self.host[t].copy_(finished, non_blocking=True)
        if self.immediate:
            self.step = t
            return
        self.in_flight.append((t, self.landed_marker()))

    def landed_marker(self) -> torch.Event:
        """An event on the device's stream after the copy: its `query()` says the copy has landed."""
        event = torch.Event(device=self.device)
        event.record()
        return event

    def wait(self) -> None:
        """Until every copy has landed: once a call, at its last step."""
        for _, marker in self.in_flight:
            marker.synchronize()

    def known(self) -> np.ndarray | None:
        """The latest finished mask that has landed [batch] (numpy: reading it is no device op), or
        None before the first."""
        while self.in_flight and self.in_flight[0][1].query():
            self.step = self.in_flight.popleft()[0]
        return None if self.step < 0 else self.host[self.step].numpy()

    def first_all_ended(self) -> int:
        """The first step at which every row had ended, of those the host knows."""
        return int(np.flatnonzero(self.host[: self.step + 1].numpy().all(axis=1))[0])


def get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)  # a GPU's: on the host, no sync


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class RngRewind:
    """Where each step of a sampled decode left the device's global RNG, for a host that learns
    late that every row had ended: it puts the RNG back to just after that step's draw, where
    `generate` (which stops drawing there) leaves it. Nothing to keep where the host learns at once."""

    def __init__(self, device: torch.device, needed: bool):
        self.device, self.needed = device, needed
        self.after_step: dict[int, torch.Tensor] = {}

    def record(self, t: int, known_step: int) -> None:
        if self.needed:
            self.after_step[t] = get_rng_state(self.device)
            # the rows had not all ended at the step the host knows (it would have stopped): the
            # step to rewind to is a later one
            for step in [s for s in self.after_step if s < known_step]:
                del self.after_step[step]

    def rewind_to(self, t: int) -> None:
        if self.needed:
            set_rng_state(self.after_step[t], self.device)


class TokenScores:
    """What the sampler knew of each token it drew, filled in by `decode`: the token's log-probability
    under the tempered softmax (before top-p: the distribution the GRPO loss's log-probs are of) and
    that distribution's entropy, [b, max_new_tokens] each; positions after a row has ended hold
    values for its padding that a response mask leaves out."""

    def __init__(self, batch: int, max_new_tokens: int, temperature: float, device: torch.device):
        if temperature <= 0:
            raise ValueError(f"token log-probabilities need a sampling temperature > 0, got {temperature}")
        self.temperature = temperature
        self.log_probs = torch.zeros(batch, max_new_tokens, device=device)
        self.entropy = torch.zeros(batch, max_new_tokens, device=device)

    def record(self, tempered: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, t: int) -> None:
        """Step t: the tempered logits of the rows still decoding [len(rows), vocab], every row's
        token [batch]."""
        # verl (and Ray, which it imports) is loaded by GRPO's rollout, the only caller, not by
        # every rank that evaluates or synthesises
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits_naive

        # verl's log_softmax + gather over all rows at once: without flash-attn, `logprobs_from_logits`
        # bounds the memory of [rows, length, vocab] logits by looping over the rows (one logsumexp per
        # row and step, a large share of the rollout), which [rows, vocab] does not need; the log-prob
        # passes bound it with chunks of rows instead (stages/grpo/logprobs.token_log_probs)
        self.log_probs[rows, t] = logprobs_from_logits_naive(tempered, tokens[rows])
        self.entropy[rows, t] = entropy_from_logits(tempered)


def prefilled(
    model, input_ids: torch.Tensor, attention: torch.Tensor, max_new_tokens: int
) -> tuple[Decoder, torch.Tensor]:
    """A decoder over the batch, prefilled, and its last hidden states. A prompt that several rows
    share (GRPO's G samples of each) is prefilled once and its cache copied to them."""
    distinct, of_row = torch.unique(torch.cat([input_ids, attention], dim=1), dim=0, return_inverse=True)
    if len(distinct) == len(input_ids):
        decoder = Decoder(model, input_ids, attention, max_new_tokens)
        return decoder, decoder.prefill()
    decoder = Decoder(model, *distinct.split(input_ids.shape[1], dim=1), max_new_tokens)
    hidden = decoder.prefill()[of_row]
    decoder.keep(of_row)
    return decoder, hidden


@torch.no_grad()
def decode(
    model,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    scores: TokenScores | None = None,
) -> torch.Tensor:
    """New tokens [b, <= max_new_tokens] after left-padded prompts; a row that has emitted eos is
    padded with pad_id after it, and the result ends at the step where every row had. The loop
    stops once the host learns so (see `EndedRows`); once it learns that a quarter of the rows being
    decoded have ended, the decoder drops them (a copy of the cache: not at every ending).
    `scores`, if given, receives each drawn token's log-probability and entropy."""
    if scores is not None and scores.temperature != temperature:
        raise ValueError(f"scores are of temperature {scores.temperature}, the sampling's is {temperature}")
    batch, device, sample = input_ids.shape[0], input_ids.device, temperature > 0
    decoder, hidden = prefilled(model, input_ids, attention, max_new_tokens)
    out = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    valid = torch.ones((), dtype=torch.bool, device=device)
    ended = EndedRows(batch, max_new_tokens, device)
    rng = RngRewind(device, needed=sample and not ended.immediate)
    rows = np.arange(batch)  # the batch rows the decoder computes, in its order
    rows_on_device = torch.arange(batch, device=device)
    width = max_new_tokens
    for t in range(max_new_tokens):
        logits = decoder.logits(hidden)
        if sample:  # once, for both the draw and `scores`
            logits = logits / temperature
        token = next_tokens(logits, rows_on_device, batch, pad_id, sample, top_p, valid)
        rng.record(t, ended.step)
        if scores is not None:
            scores.record(logits, rows_on_device, token, t)
        out[:, t] = token.masked_fill_(finished, pad_id)
        finished |= token == eos_id
        ended.send(t, finished)
        if t + 1 == max_new_tokens:
            ended.wait()
        known = ended.known()
        if known is not None and known.all():
            width = ended.first_all_ended() + 1
            rng.rewind_to(width - 1)
            break
        if t + 1 == max_new_tokens:
            break
        if known is not None and (~known[rows]).sum() <= 0.75 * len(rows):
            kept = np.flatnonzero(~known[rows])
            kept_on_device = torch.from_numpy(kept).to(device, non_blocking=True)
            decoder.keep(kept_on_device)
            rows, rows_on_device, hidden = rows[kept], rows_on_device[kept_on_device], hidden[kept_on_device]
        hidden = decoder.step(token[rows_on_device], t)
    if not bool(valid):  # multinomial's check, once a call
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    return out[:, :width]


@torch.no_grad()
def generate_tokens(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    scores: TokenScores | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(left-padded prompts, their attention mask, the new tokens [b, <= max_new_tokens]); rows that
    end early are padded after their eos. Greedy when temperature is 0, else sampling from the
    global torch RNG (and `scores` filled in, if given)."""
    device = model.lm_head.weight.device
    input_ids, attention = left_padded(prompt_ids, tokenizer.pad_token_id)
    input_ids, attention = input_ids.to(device), attention.to(device)
    new_tokens = decode(
        model,
        input_ids,
        attention,
        max_new_tokens,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        temperature,
        top_p,
        scores,
    )
    return input_ids, attention, new_tokens


def generate_responses(
    model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0
) -> list[str]:
    _, _, new_tokens = generate_tokens(
        model, tokenizer, [encode_prompt(tokenizer, p) for p in prompts], max_new_tokens, temperature, top_p
    )
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


def generate_in_batches(
    model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, batch_size: int
) -> list[str]:
    """`generate_responses` over `prompts` a batch at a time: the memory of one batch's cache."""
    responses = []
    for i in range(0, len(prompts), batch_size):
        responses += generate_responses(
            model, tokenizer, prompts[i : i + batch_size], max_new_tokens, temperature
        )
    return responses
