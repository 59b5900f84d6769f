"""GRPO's wiring checked against hand computations on toy batches (not against verl's code path):
group-normalised advantages, the clipped surrogate, the KL term, and which tokens count — never
the prompt, never the padding before a prompt or after a response's eos."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from verl.protocol import DataProto

from stages.grpo import logprobs
from stages.grpo.balance import padded_to
from stages.grpo.logprobs import micro_batches, response_log_probs, split_to, token_log_probs
from stages.grpo.losses import actor_loss, grpo_advantages, policy_loss_config
from stages.grpo.prompts import rank_share
from stages.grpo.reward import RuleReward
from stages.grpo.rollout import sequences

PAD, EOS = 0, 1
CLIP, KL_COEF = 0.2, 0.05


def toy_batch() -> DataProto:
    """Two prompts x two responses of up to three tokens; row 1 ends after two tokens (its third
    position is padding); the masked positions hold absurd values that must not matter."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    rewards = torch.zeros(4, 3)
    rewards[0, 2], rewards[1, 1], rewards[2, 2], rewards[3, 2] = 1.1, 0.1, 0.0, 1.0
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 50.0], [-0.7, -0.7, -0.7], [-2.0, -0.1, -1.0]])
    ref = torch.tensor([[-1.1, -0.4, -2.0], [-0.3, -1.0, -50.0], [-0.9, -0.6, -0.8], [-1.5, -0.1, -1.2]])
    return DataProto.from_dict(
        tensors={
            "response_mask": mask,
            "token_level_rewards": rewards,
            "old_log_probs": old,
            "ref_log_probs": ref,
        },
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )


def hand_advantages() -> list[float]:
    out = []
    for group in ([1.1, 0.1], [0.0, 1.0]):
        mean, std = statistics.mean(group), statistics.stdev(group)  # verl's torch.std is the sample std
        out += [(r - mean) / (std + 1e-6) for r in group]
    return out


def test_advantages_are_group_normalised_rewards_on_response_tokens_only():
    batch = toy_batch()
    adv = grpo_advantages(batch).batch["advantages"]
    mask = batch.batch["response_mask"]
    for row, expected in enumerate(hand_advantages()):
        for col in range(3):
            assert adv[row, col].item() == pytest.approx(expected if mask[row, col] else 0.0, abs=1e-5)


def hand_loss(log_prob: torch.Tensor, batch: DataProto) -> tuple[float, float, float]:
    """(total loss, KL, clip fraction): token means over the unmasked tokens, written out."""
    t = batch.batch
    pg_terms, kl_terms, clipped = [], [], 0
    for row, a in enumerate(hand_advantages()):
        for col in range(3):
            if not t["response_mask"][row, col]:
                continue
            lp, old, ref = (float(x[row, col]) for x in (log_prob, t["old_log_probs"], t["ref_log_probs"]))
            ratio = math.exp(lp - old)
            clipped_ratio = min(max(ratio, 1 - CLIP), 1 + CLIP)
            term = max(-a * ratio, -a * clipped_ratio)
            clipped += -a * clipped_ratio > -a * ratio
            pg_terms.append(min(term, -a * 3.0) if a < 0 else term)  # dual clip (c = 3) for a < 0
            kl_terms.append(math.exp(ref - lp) - (ref - lp) - 1)  # k3 / low_var_kl
    n = len(pg_terms)
    kl = sum(kl_terms) / n
    return sum(pg_terms) / n + KL_COEF * kl, kl, clipped / n


def test_clipped_loss_and_kl_match_hand_computation_and_ignore_masked_tokens():
    batch = toy_batch()
    batch = batch.union(grpo_advantages(batch))
    # Ratios inside and outside the clip range, for positive and negative advantages.
    log_prob = batch.batch["old_log_probs"] + torch.tensor(
        [[0.5, -0.05, 0.0], [0.3, -0.4, 9.0], [-0.5, 0.1, 0.05], [0.25, -0.3, 0.0]]
    )
    log_prob.requires_grad_(True)
    tokens = int(batch.batch["response_mask"].sum())
    loss, stats = actor_loss(
        log_prob, batch, policy_loss_config(CLIP, 2), KL_COEF, "low_var_kl", tokens, world=1
    )
    expected_loss, expected_kl, expected_clip = hand_loss(log_prob.detach(), batch)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert stats["kl"].item() == pytest.approx(expected_kl, abs=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(expected_clip, abs=1e-6)
    assert 0 < expected_clip < 1, "the toy batch must exercise both sides of the clip"
    loss.backward()
    assert log_prob.grad[1, 2] == 0, "a padding token after eos must get no gradient"


def test_rank_share_of_loss_sums_to_the_one_rank_loss():
    """Each rank's loss is its token sum over the global token count, times the ranks: the mean
    over ranks (what FSDP's gradient average computes) is the one-rank loss."""
    batch = toy_batch()
    batch = batch.union(grpo_advantages(batch))
    log_prob = batch.batch["old_log_probs"] + 0.1
    config = policy_loss_config(CLIP, 2)
    tokens = int(batch.batch["response_mask"].sum())
    whole, _ = actor_loss(log_prob, batch, config, KL_COEF, "low_var_kl", tokens, world=1)
    halves = [
        actor_loss(log_prob[i : i + 2], part, config, KL_COEF, "low_var_kl", tokens, world=2)[0]
        for i, part in zip((0, 2), batch.chunk(2))
    ]
    assert (halves[0] + halves[1]).item() / 2 == pytest.approx(whole.item(), abs=1e-6)


def test_response_mask_ends_at_first_eos_and_positions_skip_left_padding():
    prompt = torch.tensor([[PAD, 5, 6], [7, 8, 9]])
    prompt_mask = (prompt != PAD).long()
    responses = torch.tensor([[4, EOS, PAD, PAD], [4, 4, 4, 4]])
    seq = sequences(prompt, prompt_mask, responses, EOS)
    assert seq["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert seq["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert seq["position_ids"][0, 1:5].tolist() == [0, 1, 2, 3]
    assert seq["position_ids"][1].tolist() == list(range(7))


def test_batched_log_probs_equal_unpadded_single_sequence_log_probs():
    """The one batched forward (left-padded prompts, responses padded after eos) gives each response
    token the log-probability a forward over that sequence alone, without any padding, gives."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            pad_token_id=PAD,
            eos_token_id=EOS,
            bos_token_id=None,
        )
    ).eval()
    prompts, answers = [[5, 6], [7, 8, 9, 10]], [[11, EOS], [12, 13, 14]]
    width = max(map(len, prompts))
    prompt = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    responses = torch.tensor([a + [PAD] * (3 - len(a)) for a in answers])
    batch = DataProto.from_dict(
        tensors=sequences(prompt, (prompt != PAD).long(), responses, EOS), meta_info={"temperature": 1.0}
    )
    with torch.no_grad():
        batched, _ = response_log_probs(model, batch)
        for row, (p, a) in enumerate(zip(prompts, answers)):
            logits = model(torch.tensor([p + a])).logits[0].log_softmax(-1)
            alone = [logits[len(p) - 1 + i, tok].item() for i, tok in enumerate(a)]
            assert batched[row, : len(a)].tolist() == pytest.approx(alone, abs=1e-5)


@pytest.mark.parametrize("chunk_rows", [1, 2, 5])
def test_token_log_probs_in_chunks_equal_log_softmax_and_its_gradient(monkeypatch, chunk_rows):
    """Values and gradients of the chunked logsumexp are log_softmax's, whether the rows fit one chunk
    (5 rows), split evenly (1 a chunk) or leave a remainder (2, 2, 1)."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 7, 11)).requires_grad_()
    tokens = torch.randint(0, 11, (5, 7))
    monkeypatch.setattr(logprobs, "LOGSUMEXP_CHUNK_BYTES", chunk_rows * 7 * 11 * 4)
    weights = torch.rand(5, 7)
    ours = token_log_probs(logits, tokens)
    (ours_grad,) = torch.autograd.grad((ours * weights).sum(), logits)
    reference = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_grad, reference_grad, rtol=0, atol=1e-6)


def test_reward_sits_on_the_last_response_token():
    batch = DataProto.from_dict(
        tensors={"response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])},
        non_tensors={
            "response_text": np.array(
                ["<think>1+1=2</think><answer>2</answer>", "<answer>3</answer>"], dtype=object
            ),
            "answer": np.array(["2", "2"], dtype=object),
        },
    )
    out = RuleReward(format_weight=0.1)(batch)
    assert out.batch["token_level_rewards"].flatten().tolist() == pytest.approx([0, 1.1, 0, 0, 0, 0])
    assert out.non_tensor_batch["correct"].tolist() == [True, False]


def test_mini_batch_m_holds_the_same_prompts_on_one_rank_and_on_two():
    global_batch = list(range(8))
    one = rank_share(global_batch, 0, 1, mini_batches=2)
    two = [rank_share(global_batch, r, 2, mini_batches=2) for r in range(2)]
    for m in range(2):
        assert sorted(one[m * 4 : (m + 1) * 4]) == sorted(
            two[0][m * 2 : (m + 1) * 2] + two[1][m * 2 : (m + 1) * 2]
        )


def test_length_sorted_micro_batches_give_the_one_forward_log_probs_and_entropy():
    """Forwarding rows in length-sorted micro-batches, each cut at its longest response, gives every
    response token the log-prob and entropy of one forward over the whole padded batch."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            pad_token_id=PAD,
            eos_token_id=EOS,
            bos_token_id=None,
        )
    ).eval()
    prompt = torch.tensor([[PAD, 5, 6], [7, 8, 9], [PAD, PAD, 4], [3, 2, 5], [PAD, 6, 6]])
    responses = torch.tensor(
        [
            [11, EOS, PAD, PAD, PAD],
            [12, 13, 14, 15, 9],
            [EOS, PAD, PAD, PAD, PAD],
            [4, 4, EOS, PAD, PAD],
            [7, 8, 9, EOS, PAD],
        ]
    )
    batch = DataProto.from_dict(
        tensors=sequences(prompt, (prompt != PAD).long(), responses, EOS), meta_info={"temperature": 0.7}
    )
    mask = batch.batch["response_mask"].bool()
    with torch.no_grad():
        whole, whole_entropy = response_log_probs(model, batch, with_entropy=True)
        for size in (1, 2, 3):
            parts, entropy = response_log_probs(model, batch, with_entropy=True, micro_batch_size=size)
            assert torch.allclose(parts[mask], whole[mask], atol=1e-5), size
            assert torch.allclose(entropy[mask], whole_entropy[mask], atol=1e-5), size


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            pad_token_id=PAD,
            eos_token_id=EOS,
            bos_token_id=None,
        )
    )


def grouped_batch(prompts: list[list[int]], group_size: int) -> DataProto:
    """Each prompt `group_size` times, left-padded to the longest, the rows shuffled (a group's rows are
    not neighbours); responses of random tokens ending at a random eos, or at none."""
    g = torch.Generator().manual_seed(7)
    width, rows, response_width = max(map(len, prompts)), len(prompts) * group_size, 6
    order = torch.randperm(rows, generator=g)
    prompt = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts]).repeat_interleave(
        group_size, dim=0
    )[order]
    responses = torch.randint(2, 16, (rows, response_width), generator=g)
    for row, end in enumerate(torch.randint(0, response_width + 1, (rows,), generator=g).tolist()):
        responses[row, end : end + 1] = EOS
        responses[row, end + 1 :] = PAD
    return DataProto.from_dict(
        tensors=sequences(prompt, (prompt != PAD).long(), responses, EOS), meta_info={"temperature": 0.7}
    )


def full_forward_log_probs(model, batch: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one plain forward over every whole prompt+response row; the log-probs of the
    response tokens under the tempered logits of the positions before them, and their entropy."""
    t = batch.batch
    logits = model(
        input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
    ).logits
    start = t["prompts"].shape[1]
    log_p = (logits[:, start - 1 : -1] / batch.meta_info["temperature"]).log_softmax(dim=-1)
    return log_p.gather(-1, t["responses"][..., None])[..., 0], -(log_p.exp() * log_p).sum(dim=-1)


PROMPTS = [[5, 6], [7, 8, 9, 10], [3], [4, 4, 2]]


def weighted_sum_gradients(model, log_probs: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((log_probs * weights).sum(), list(model.parameters())))


@pytest.mark.parametrize("group_size", [3, 1])  # 1: no two prompts are equal
@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("micro_batch_size", [None, 1, 3, 5])
def test_log_probs_and_entropy_equal_the_full_forward_with_prompts_shared_or_not(
    micro_batch_size, share_prompts, group_size
):
    model = tiny_llama().eval()
    batch = grouped_batch(PROMPTS, group_size)
    mask = batch.batch["response_mask"].bool()
    with torch.no_grad():
        expected, expected_entropy = full_forward_log_probs(model, batch)
        log_probs, entropy = response_log_probs(
            model, batch, with_entropy=True, micro_batch_size=micro_batch_size, share_prompts=share_prompts
        )
    assert torch.allclose(log_probs[mask], expected[mask], atol=1e-5)
    assert torch.allclose(entropy[mask], expected_entropy[mask], atol=1e-5)


@pytest.mark.parametrize("group_size", [3, 1])
@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_gradients_through_shared_prompts_equal_the_full_forward_gradients(micro_batch_size, group_size):
    """Every parameter's gradient, the prompts' share included (summed over the rows sharing each)."""
    model = tiny_llama()
    batch = grouped_batch(PROMPTS, group_size)
    weights = torch.randn(batch.batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    weights *= batch.batch["response_mask"]  # past a response's end the two ways need not agree
    expected = weighted_sum_gradients(model, full_forward_log_probs(model, batch)[0], weights)
    actual = weighted_sum_gradients(
        model, response_log_probs(model, batch, micro_batch_size=micro_batch_size)[0], weights
    )
    for (name, _), grad, expected_grad in zip(model.named_parameters(), actual, expected):
        assert torch.allclose(grad, expected_grad, rtol=1e-4, atol=1e-6), name


def test_each_distinct_prompt_is_forwarded_once():
    model = tiny_llama()
    forwarded = []
    model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: forwarded.append(tuple(args[0].shape))
    )
    with torch.no_grad():
        response_log_probs(model, grouped_batch(PROMPTS, group_size=3), micro_batch_size=5)
    prompt_width, response_width = max(map(len, PROMPTS)), 6
    assert forwarded[0] == (len(PROMPTS), prompt_width)
    assert sum(rows for rows, _ in forwarded[1:]) == 3 * len(PROMPTS)
    assert all(columns <= response_width for _, columns in forwarded[1:])


@pytest.mark.parametrize("share_prompts", [True, False])
def test_rows_padded_for_the_move_between_ranks_keep_their_log_probs(share_prompts):
    """balance_across_ranks pads every rank's rows to the widest prompt and response of any rank:
    the padding must change no response token's log-probability or entropy."""
    model, batch = tiny_llama().eval(), grouped_batch(PROMPTS, group_size=2)
    width = batch.batch["responses"].shape[1]
    padded = padded_to(batch, batch.batch["prompts"].shape[1] + 3, width + 4)
    with torch.no_grad():
        log_probs, entropy = response_log_probs(model, batch, with_entropy=True, share_prompts=share_prompts)
        wider, wider_entropy = response_log_probs(
            model, padded, with_entropy=True, share_prompts=share_prompts
        )
    mask = batch.batch["response_mask"].bool()
    assert torch.allclose(wider[:, :width][mask], log_probs[mask], atol=1e-5)
    assert torch.allclose(wider_entropy[:, :width][mask], entropy[mask], atol=1e-5)
    assert not padded.batch["response_mask"][:, width:].any()


def test_micro_batches_hold_at_most_max_rows_and_cut_where_responses_halve():
    lengths = torch.tensor([10, 53, 9, 52, 10, 53, 53, 25, 27])
    groups = micro_batches(lengths, max_rows=3)
    assert [lengths[g].tolist() for g in groups] == [[53, 53, 53], [52, 27], [25], [10, 10, 9]]
    assert sorted(torch.cat(groups).tolist()) == list(range(len(lengths)))
    assert [len(g) for g in micro_batches(torch.full((7,), 4), max_rows=3)] == [3, 3, 1]
    by_count = micro_batches(lengths, max_rows=3, cut_where_halved=False)
    assert [lengths[g].tolist() for g in by_count] == [[53, 53, 53], [52, 27, 25], [10, 10, 9]]


def test_split_to_halves_the_largest_micro_batches_until_there_are_enough():
    # A rank whose responses cut into fewer micro-batches than another's makes as many forwards.
    groups = [torch.arange(0, 5), torch.arange(5, 7)]
    split = split_to(groups, 4)
    assert [g.tolist() for g in split] == [[0, 1], [2], [3, 4], [5, 6]]
    assert split_to(groups, 2) == groups
    with pytest.raises(ValueError, match="3 micro-batches of 2 rows"):
        split_to([torch.tensor([0]), torch.tensor([1])], 3)
