"""The emulated accelerator (tests/fakegpu) on 2 real ranks, each on the device of its local rank:
its backend behaves as nccl (a CPU tensor refused with NCCL's message; reductions and object
collectives on the device), DDP, FSDP2 and DeepSpeed ZeRO-1 on it compute what they compute on the
CPU, and megatron-core, through the project's CPU shim, gives the same loss at TP=2 as at TP=1. The
comparisons are exact: the emulated device runs the same CPU kernels in the same order.
ZeRO-1 against torch's AdamW guards the trap an emulation can fall into silently (DeepSpeed points
`param.data` at its buffers: without the wrapper's data setter the weights never move)."""

from __future__ import annotations

import pytest

from tests import fakegpu
from tests.conftest import REPO, run_torchrun
from tests.dist.workers.results import read_results

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "fakegpu_ranks.py"


@pytest.fixture(scope="module")
def found() -> dict:
    """{check: [value on rank 0, value on rank 1]}."""
    out = run_torchrun(WORKER, 2, env=fakegpu.child_env({"PYTHONPATH": str(REPO)})).stdout
    values: dict = {}
    for item in sorted(read_results(out), key=lambda item: item["rank"]):
        values.setdefault(item["check"], []).append(item["value"])
    return values


def test_each_rank_is_on_its_own_device_with_the_devices_backend(found):
    assert found["device"] == ["fakegpu:0", "fakegpu:1"]
    assert found["backend"] == ["fakeccl", "fakeccl"]


def test_a_cpu_tensor_in_a_collective_is_refused_as_nccl_refuses_it(found):
    assert found["cpu_refused"] == ["No backend type associated with device type cpu"] * 2


def test_reductions_run_on_the_device_and_honour_the_op(found):
    # rank r contributes r + 1
    for op, value in (("SUM", 3.0), ("AVG", 1.5), ("MAX", 2.0), ("MIN", 1.0)):
        assert found[op] == [["fakegpu:0", value, value], ["fakegpu:1", value, value]], op
    assert found["objects"] == [[0, 1], [0, 1]]


def test_the_other_collectives_give_what_nccl_gives(found):
    # rank r contributes values plus 10 r
    rank0, rank1 = found["other_ops"]
    assert rank0["broadcast"] == rank1["broadcast"] == [[11.0]]  # from rank 1
    assert rank0["reduce"] == [[12.0]]  # to rank 0
    assert (rank0["reduce_scatter"], rank1["reduce_scatter"]) == ([[12.0]], [[14.0]])
    assert (rank0["scatter"], rank1["scatter"]) == ([[1.0]], [[2.0]])  # rank 0's list
    assert (rank0["all_to_all_single"], rank1["all_to_all_single"]) == ([[1.0, 11.0]], [[2.0, 12.0]])
    assert rank0["gather"] == [[1.0], [11.0]]
    assert rank1["send_recv"] == [[1.0]]  # rank 0's


def test_ddp_averages_gradients_as_the_cpu_reference(found):
    assert found["grad_device"] == ["fakegpu:0", "fakegpu:1"]
    assert found["ddp_vs_cpu"] == [0.0, 0.0]


def test_fsdp2_gradients_equal_ddps_and_unsharded_weights_are_freed(found):
    assert found["fsdp2_vs_ddp"] == [0.0, 0.0]
    # half of each weight after sharding; still that after the forward (the unsharded weights were
    # freed); plus half of each gradient after the backward
    assert found["fsdp2_memory"] == [[1.0, 1.0, 2.0]] * 2


def test_deepspeed_zero1_step_equals_torch_adamw_on_both_ranks(found):
    assert found["zero1_vs_adamw"] == [0.0, 0.0]
    assert min(found["zero1_moved"]) > 1e-3  # the step did move the weights
    # DeepSpeed moving a CPU model whose optimizer was made first: the move kept the parameters
    assert found["zero1_moved_by_deepspeed_vs_adamw"] == [0.0, 0.0]


def test_megatron_through_the_cpu_shim_runs_on_the_device_and_tp2_equals_tp1(found):
    tp1, tp2 = found["megatron_tp1"], found["megatron_tp2"]
    # Each size's ranks agree exactly; the sizes only to fp32 rounding: TP=2 sums a row-parallel
    # product in two halves, which some CPUs' kernels round differently (AVX-512 Xeon: 1 ulp).
    assert tp1[0]["loss"] == tp1[1]["loss"] and tp2[0]["loss"] == tp2[1]["loss"]
    assert tp2[0]["loss"] == pytest.approx(tp1[0]["loss"], rel=1e-6, abs=0)
    assert [r["grad_device"] for r in tp2] == ["fakegpu:0", "fakegpu:1"]
    for rank, r in enumerate(tp2):  # token ids left on the CPU are refused at the embedding
        assert r["cpu_ids"].startswith(
            "Expected all tensors to be on the same device, but got indices is on cpu, different from other "
            f"tensors on fakegpu:{rank}"
        )
