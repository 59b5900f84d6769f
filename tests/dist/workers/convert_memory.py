"""Worker: how much host memory a rank takes to load a few-hundred-MB model into megatron (TP=2:
streamed and, as the reference, from whole HF tensors; TP=1: streamed) and rank 0 to export it
(TP=2); then, as the GRPO roles do, to load the model's bf16 copy into FSDP2 in fp32 (streamed, and
whole then sharded). Each rank prints `RESULT {json}` lines: bytes of its shard and the growth of
its anonymous memory, peak minus what it had before. argv: HF_DIR OUT_DIR BF16_HF_DIR

Anonymous memory (RssAnon), not the whole RSS: the loader reads memory-mapped safetensors files,
and the clean file pages it touches count in RSS (RssFile) although the kernel can drop them at any
time. A column slice of a row-major tensor touches every page of it, so RSS would rise towards
the file's size whatever the loader keeps. What fills a node and gets ranks killed is anonymous
memory: the tensors a rank allocates. A thread samples it every millisecond; the weights a load
keeps are alive for the rest of the measurement, so the peak cannot slip between samples. The
test sets MALLOC_MMAP_THRESHOLD_ so that freed tensors go back to the kernel at once and one
measurement does not inherit the heap of the one before."""

import gc
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from launch.worker import leave_now
from runtime.dist import init_distributed, shutdown_distributed
from stages.engines import fsdp2
from stages.engines.cpu_shim import apply_cpu_shim
from stages.models.convert import export_megatron_to_hf, hf_to_megatron, load_hf_into_megatron
from stages.models.hf_files import HFCheckpoint
from stages.models.megatron_llama import build_megatron_llama
from tests.dist.workers.results import print_result


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


class PeakGrowth:
    """Peak RssAnon (and RssFile, for the record) during the block, minus its value before."""

    def __init__(self):
        # What the last measurement left in reference cycles (FSDP2's modules) must not be freed
        # during this one: it would hide as much of this one's growth.
        gc.collect()
        self.base = {f: status_bytes(f) for f in ("RssAnon", "RssFile")}
        self.peak = dict(self.base)
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def record(self):
        with self.lock:  # the sampler and a loader's own record() must not undo each other's peak
            for field in self.peak:
                self.peak[field] = max(self.peak[field], status_bytes(field))

    def sample(self):
        while True:
            self.record()
            if self.done.wait(0.001):
                return

    def __enter__(self):
        self.started = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.started
        self.done.set()
        self.thread.join()
        self.record()

    def grown(self, field: str = "RssAnon") -> int:
        return self.peak[field] - self.base[field]


def report(check: str, **values) -> None:
    print_result({"rank": dist.get_rank(), "check": check, **values})


def build(config):
    """Without megatron's random init: on CPU it makes a full-size copy of each tensor for a moment
    (on GPUs it initialises the shard on the device), which is the model's doing, not the loader's."""
    return build_megatron_llama(config, perform_initialization=False)


def shard_bytes(model) -> int:
    return sum(
        t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor)
    )


def load_from_whole_tensors(model, hf_dir: Path, config, measured: PeakGrowth) -> None:
    """The loader before streaming: whole HF tensors read one by one, cut into a shard dict, loaded.
    Its peak, the shard dict beside the loaded weights, lasts only until it returns: too short for
    the sampler to be sure to see on two busy cores (seen: 205 MB of 350), so it is recorded there."""
    tp, tp_size = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    shard = hf_to_megatron(HFCheckpoint(hf_dir), config, tp, tp_size, 0, 1)
    model.load_state_dict(shard, strict=False)
    measured.record()


def load_streamed(model, hf_dir: Path, config, measured: PeakGrowth) -> None:
    load_hf_into_megatron(model, hf_dir, config)


def measure_load(tp: int, load, hf_dir: Path, config, check: str):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    with PeakGrowth() as m:
        model = build(config)
        load(model, hf_dir, config, m)
    report(
        check,
        tp=tp,
        shard_bytes=shard_bytes(model),
        anon=m.grown(),
        file=m.grown("RssFile"),
        seconds=m.seconds,
    )
    return model


def load_whole_then_shard(hf_dir: Path, trainable: bool):
    """The GRPO roles' loader before streaming: the whole model on every rank, then sharded."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def measure_fsdp2_load(load, hf_dir: Path, check: str) -> None:
    """The GRPO actor's and reference's load (FSDP2 over both ranks) of a bf16 checkpoint into fp32."""
    with PeakGrowth() as m:
        model = load(hf_dir, trainable=False)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    report(
        check,
        tp=dist.get_world_size(),
        shard_bytes=shard,
        anon=m.grown(),
        file=m.grown("RssFile"),
        seconds=m.seconds,
    )


def main():
    hf_dir, out, bf16_dir = map(Path, sys.argv[1:4])
    init_distributed()
    apply_cpu_shim()
    config = AutoConfig.from_pretrained(hf_dir)

    model = measure_load(2, load_streamed, hf_dir, config, "stream_load")
    with PeakGrowth() as m:
        export_megatron_to_hf(model, config, out / "export", max_shard_bytes=100 * 2**20)
    report("export", tp=2, anon=m.grown(), file=m.grown("RssFile"), seconds=m.seconds)
    del model
    parallel_state.destroy_model_parallel()

    measure_load(2, load_from_whole_tensors, hf_dir, config, "whole_load")
    parallel_state.destroy_model_parallel()
    measure_load(1, load_streamed, hf_dir, config, "stream_load")
    parallel_state.destroy_model_parallel()
    measure_fsdp2_load(fsdp2.load_sharded, bf16_dir, "fsdp2_load")
    measure_fsdp2_load(load_whole_then_shard, bf16_dir, "fsdp2_whole_load")
    shutdown_distributed()


if __name__ == "__main__":
    main()
    leave_now(0)
