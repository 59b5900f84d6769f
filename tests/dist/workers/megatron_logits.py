"""Worker: on 2 ranks, for TP=2 and then PP=2, and for a model whose output layer is tied to its
embedding at TP=2, megatron's logits, loss and gradients vs Hugging Face's on the same weights
(computed here, on every rank; the megatron model streams its shard from a sharded HF directory),
the gathered shards converted back to the HF weights, the streamed export read back, and the RNG
tracker's streams; the tied model at PP=2 is refused. Rank 0 prints every rank's findings as
`RESULT {json}` lines (one writer: lines of concurrent ranks can interleave). argv: OUT_DIR"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from launch.worker import leave_now
from runtime.dist import init_distributed, shutdown_distributed
from stages.engines.cpu_shim import apply_cpu_shim
from stages.models.convert import export_megatron_to_hf, load_hf_into_megatron, megatron_to_hf
from stages.models.hf_files import read_hf_weights, save_hf_dir
from stages.models.megatron_llama import build_megatron_llama
from tests.dist.workers.results import print_result
from tests.support.llama_configs import GQA_LLAMA, GQA_LLAMA_TIED

CONFIG, TIED = GQA_LLAMA, GQA_LLAMA_TIED
SEQ, MICRO_BATCH, MICRO_BATCHES = 16, 2, 2
LENGTHS = [16, 11, 6, 14]  # right padding; loss and comparisons only on real tokens
SHARD_BYTES = 50_000  # several files and an index, as a big model's directory has
FINDINGS = []  # this rank's {"layout", "check", "value"}


def report(layout: str, check: str, value) -> None:
    FINDINGS.append({"layout": layout, "check": check, "value": value})


def print_findings_on_rank0() -> None:
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(FINDINGS, everyone, dst=0)
    for finding in sum(everyone or [], []):
        print_result(finding)


def make_batch():
    ids = torch.randint(0, CONFIG.vocab_size, (len(LENGTHS), SEQ), generator=torch.Generator().manual_seed(1))
    real = torch.tensor([[1.0] * n + [0.0] * (SEQ - n) for n in LENGTHS])
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = real * torch.roll(real, -1, dims=1)  # the last real token has no next token
    return ids, labels, real, loss_mask


def micro_batches(*tensors) -> list[tuple]:
    return [tuple(t[i * MICRO_BATCH : (i + 1) * MICRO_BATCH] for t in tensors) for i in range(MICRO_BATCHES)]


def run_schedule(model, step, batches: list, forward_only: bool) -> list:
    """megatron's schedule (1F1B at PP>1) over the micro-batches; what the last stage collected."""
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=forward_only,
    )


def megatron_logits(model, ids) -> torch.Tensor | None:
    """Full-vocabulary logits on the last pipeline stage (None on the others)."""
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)

    def step(data_iterator, model):
        (micro_ids,) = next(data_iterator)
        return model(micro_ids, positions, None), None  # no loss_func: the schedule keeps the output

    with torch.no_grad():
        outputs = run_schedule(model, step, micro_batches(ids), forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    local = torch.cat(outputs)  # [batch, seq, vocab / tp]: the output layer is vocab-parallel
    pieces = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, local, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1)


def megatron_loss_and_backward(model, ids, labels, loss_mask) -> float | None:
    """Mean token loss over the whole batch (calculate_per_token_loss: the schedule does not
    average over micro-batches); gradients land in .grad."""
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    total_tokens = loss_mask.sum()

    def step(data_iterator, model):
        micro_ids, micro_labels, mask = next(data_iterator)
        token_losses = model(micro_ids, positions, None, labels=micro_labels)  # [micro batch, seq]

        def loss_func(losses):  # (loss to backpropagate, its token count, what the schedule returns)
            loss = (losses * mask).sum() / total_tokens
            return loss, mask.sum().int(), {"loss": loss.detach()}

        return token_losses, loss_func

    outputs = run_schedule(model, step, micro_batches(ids, labels, loss_mask), forward_only=False)
    return sum(o["loss"] for o in outputs).item() if parallel_state.is_pipeline_last_stage() else None


def hf_model(config: LlamaConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank and in every layout
    return LlamaForCausalLM(config)


def hf_weights(hf: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights, each once: a tied head is its embedding, and has no name of its own."""
    return {name: p.detach() for name, p in hf.named_parameters()}


def hf_reference(config: LlamaConfig, ids, labels, loss_mask):
    """HF's model with the gradients of the mean token loss, its logits and that loss."""
    hf = hf_model(config)
    logits = hf(input_ids=ids).logits
    token_losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    loss = (token_losses * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    return hf, logits.detach(), loss.item()


def max_diff_at_real_tokens(ours, theirs, real) -> float:
    return ((ours - theirs).abs().amax(dim=-1) * real).max().item()


def max_relative_grad_diff(ours: dict, hf) -> float:
    """Over the HF tensors: max |ours - HF's| / max |HF's| (a tied embedding's gradient sums its
    two uses)."""
    return max(((ours[k] - p.grad).abs().max() / p.grad.abs().max()).item() for k, p in hf.named_parameters())


def check_rng_streams(layout: str) -> None:
    """The tracker's model-parallel stream differs across TP ranks, advances between forks, and
    leaves the default stream (equal across TP ranks) where it was."""
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    draws = [None] * dist.get_world_size()
    dist.all_gather_object(draws, (first, second, torch.rand(4)))
    if dist.get_rank() == 0:
        (a1, a2, a_default), (b1, _, b_default) = draws
        report(
            layout,
            "rng",
            {
                "tp_ranks_differ": not torch.equal(a1, b1),
                "advances": not torch.equal(a1, a2),
                "default_equal": torch.equal(a_default, b_default),
            },
        )


def gather_shards(local: dict[str, torch.Tensor]) -> list[list[dict]] | None:
    """Every (pp, tp) rank's `local` dict of data-parallel replica 0 on global rank 0, as
    shards[pp_rank][tp_rank] (None elsewhere): the whole model at once, as megatron_to_hf takes it."""
    mine = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        {k: v.detach().cpu() for k, v in local.items() if not k.endswith("_extra_state")},
    )
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if parallel_state.get_data_parallel_rank() == 0 else None, gathered, dst=0)
    if gathered is None:
        return None
    shards = [
        [None] * parallel_state.get_tensor_model_parallel_world_size()
        for _ in range(parallel_state.get_pipeline_model_parallel_world_size())
    ]
    for pp, tp, state in filter(None, gathered):
        shards[pp][tp] = state
    return shards


def check_layout(layout: str, config: LlamaConfig, tp: int, pp: int, hf_dir: Path, out: Path) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    ids, labels, real, loss_mask = make_batch()
    hf, hf_logits, hf_loss = hf_reference(config, ids, labels, loss_mask)
    model = build_megatron_llama(config, calculate_per_token_loss=True)
    load_hf_into_megatron(model, hf_dir)

    logits = megatron_logits(model, ids)
    if logits is not None:
        report(layout, "logits", max_diff_at_real_tokens(logits, hf_logits, real))
    loss = megatron_loss_and_backward(model, ids, labels, loss_mask)
    if loss is not None:
        report(layout, "loss", abs(loss - hf_loss))
    grads = gather_shards({name: p.grad for name, p in model.named_parameters()})
    shards = gather_shards(model.state_dict())
    if shards is not None:
        report(layout, "grads", max_relative_grad_diff(megatron_to_hf(grads, config), hf))
        back, expected = megatron_to_hf(shards, config), hf_weights(hf)
        report(
            layout,
            "gather_exact",
            back.keys() == expected.keys() and all(torch.equal(back[k], v) for k, v in expected.items()),
        )
    export_megatron_to_hf(model, config, out / layout, max_shard_bytes=SHARD_BYTES)
    if dist.get_rank() == 0:
        back, expected = read_hf_weights(out / layout), hf_weights(hf)
        report(
            layout,
            "export_exact",
            back.keys() == expected.keys() and all(torch.equal(back[k], v) for k, v in expected.items()),
        )
        check_export_loads_in_hf(layout, out / layout, hf_logits, ids, real)
    if tp > 1:
        check_rng_streams(layout)
    parallel_state.destroy_model_parallel()


def check_export_loads_in_hf(layout: str, exported: Path, hf_logits, ids, real) -> None:
    """transformers reads the export back with the head tied as the original was, and the same logits."""
    hf = AutoModelForCausalLM.from_pretrained(exported)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    report(
        layout,
        "hf_reload",
        {
            "tied": hf.lm_head.weight is hf.model.embed_tokens.weight,
            "logits": max_diff_at_real_tokens(logits, hf_logits, real),
        },
    )


def check_tied_pipeline_refused() -> None:
    """The tied model at PP=2 is refused before megatron builds anything, naming the fields."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    try:
        build_megatron_llama(TIED)
        report("tied-tp1pp2", "refused", None)
    except ValueError as e:
        report("tied-tp1pp2", "refused", str(e))
    parallel_state.destroy_model_parallel()


def main():
    out = Path(sys.argv[1])
    init_distributed()
    apply_cpu_shim()
    if dist.get_rank() == 0:
        save_hf_dir(hf_model(CONFIG).state_dict(), CONFIG, out / "hf", max_shard_bytes=SHARD_BYTES)
        # as transformers writes a tied checkpoint: no lm_head.weight
        hf_model(TIED).save_pretrained(out / "hf-tied", max_shard_size=SHARD_BYTES)
    dist.barrier()
    for layout, config, tp, pp, hf_dir in (
        ("tp2pp1", CONFIG, 2, 1, "hf"),
        ("tp1pp2", CONFIG, 1, 2, "hf"),
        ("tied-tp2pp1", TIED, 2, 1, "hf-tied"),
    ):
        check_layout(layout, config, tp, pp, out / hf_dir, out)
    check_tied_pipeline_refused()
    print_findings_on_rank0()
    shutdown_distributed()


if __name__ == "__main__":
    main()
    leave_now(0)
