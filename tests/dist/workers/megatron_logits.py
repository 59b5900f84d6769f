"""Worker: megatron logits at a TP/PP layout vs Hugging Face's on the same weights, and the
gathered shards converting back to the HF weights exactly. argv: TP PP OUT_DIR"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from transformers import LlamaConfig, LlamaForCausalLM

from launch.dist import init_distributed
from stages.engines.cpu_shim import apply_cpu_shim
from stages.models.convert import gather_megatron_shards, load_hf_into_megatron, megatron_to_hf, save_hf_dir
from stages.models.megatron_llama import build_megatron_llama

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=96, max_position_embeddings=64,
                     tie_word_embeddings=False, rms_norm_eps=1e-5)


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits on the last pipeline stage (None on the others)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)

    def forward_step(data_iterator, model):
        output = model(ids, positions, None)
        # With collect_non_loss_data, whatever this returns is collected: the logits themselves.
        return output, lambda out, non_loss_data=True: out

    outputs = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                          num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                          forward_only=True, collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    local = outputs[0]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(pieces, local.contiguous(), group=tp_group)
    return torch.cat(pieces, dim=-1)


def main():
    tp, pp, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    init_distributed()
    apply_cpu_shim()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(CONFIG).eval()
    if dist.get_rank() == 0:
        save_hf_dir(hf.state_dict(), CONFIG, out / "hf")
    dist.barrier()
    model = build_megatron_llama(CONFIG).eval()
    load_hf_into_megatron(model, out / "hf", CONFIG)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = megatron_logits(model, ids)
        if logits is not None:
            diff = (logits - hf(input_ids=ids).logits).abs().max().item()
            print(f"LOGITS_MAX_DIFF {diff}", flush=True)
    shards = gather_megatron_shards(model)
    if shards is not None:
        back = megatron_to_hf(shards, CONFIG)
        exact = all(torch.equal(back[k], v) for k, v in hf.state_dict().items()) and back.keys() == hf.state_dict().keys()
        print(f"GATHER_EXACT {exact}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
