"""The emulated accelerator (tests/fakegpu) in one process with two devices: it is PyTorch's
accelerator, it refuses what CUDA refuses with CUDA's words and accepts what CUDA accepts, moves,
autograd, saving, streams and events work, and its memory ledger is exact.

The checks run in a fresh process started as the stages' ranks are (fakegpu.child_env: installed at
startup): installing the device in the test process would make it every later test's accelerator.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import fakegpu
from tests.conftest import REPO, hpcr1_env
from tests.dist.workers.results import read_results

SAME_DEVICE = "Expected all tensors to be on the same device"


@pytest.fixture(scope="module")
def seen() -> dict:
    """{check: what the fresh process saw}."""
    worker = REPO / "tests" / "unit" / "fakegpu_device.py"
    env = fakegpu.child_env({**hpcr1_env(), fakegpu.COUNT_VAR: "2"})
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {item["check"]: item["value"] for item in read_results(proc.stdout)}


def test_pytorch_finds_it_as_its_accelerator(seen):
    assert seen["accelerator"] == {
        "type": "fakegpu",
        "count": 2,
        "backend": "fakeccl",
        "selected": 1,  # torch.accelerator.set_device_index works
        "unindexed_tensor": "fakegpu:0",  # "fakegpu" alone means the current device, as "cuda" does
    }


def test_a_cpu_batch_into_a_module_on_the_device_is_refused_in_cudas_words(seen):
    message = seen["cpu_batch_into_device_module"]
    assert message.startswith(
        f"{SAME_DEVICE}, but got mat1 is on cpu, different from other tensors on fakegpu:0"
    )


def test_a_device_past_the_last_is_refused(seen):
    assert seen["a_device_past_the_last"] == "fakegpu error: invalid device ordinal 2 (2 devices)"


def test_cpu_scalars_and_cpu_indices_are_accepted_as_cuda_accepts_them(seen):
    assert seen["cpu_scalar_with_device_tensor"] == "fakegpu:0"
    assert seen["cpu_indices"] == [9.0, 4.0]


def test_a_cpu_scalar_is_not_written_with_device_values(seen):
    assert seen["device_tensor_into_cpu_scalar"].startswith(
        f"{SAME_DEVICE}, but got self is on cpu, different from other tensors on fakegpu:0"
    )


def test_tensors_of_two_devices_in_one_op_are_refused(seen):
    assert (
        seen["two_devices_in_one_op"]
        == f"{SAME_DEVICE}, but found at least two devices, fakegpu:0 and fakegpu:1!"
    )


def test_moves_cpu_gives_a_plain_cpu_tensor(seen):
    moves = seen["moves"]
    assert moves["to_device"] == "fakegpu:1" and moves["dtype_change_stays"] == "fakegpu:1"
    assert (moves["cpu_type"], moves["to_cpu_type"], moves["cpu_device"]) == ("Tensor", "Tensor", "cpu")
    assert moves["values_kept"]
    assert moves["numpy_refused"].startswith("can't convert fakegpu:1 device type tensor to numpy")


def test_autograd_runs_on_a_device_other_than_0(seen):
    assert seen["autograd_on_device_1"] == {"device": "fakegpu:1", "grad": [2.0, 4.0, 6.0]}


def test_torch_save_and_load_keep_the_device_or_map_to_the_cpu(seen):
    assert seen["save_and_load"] == {
        "device": "fakegpu:1",
        "values": [0.0, 1.0, 2.0, 3.0],
        "mapped": "cpu",
        "callable_map_location": "cpu",  # as DeepSpeed's load_checkpoint asks
    }


def test_memory_ledger_counts_each_storage_once_while_it_lives(seen):
    ledger = seen["memory_ledger"]
    # 4 MiB tensor, + a view (nothing), + a product (4), - the product, - the tensor (its view still
    # holds the storage), - the view, + a tensor on device 1 (not device 0's memory)
    assert ledger["steps"] == [4.0, 4.0, 8.0, 4.0, 4.0, 0.0, 0.0]
    assert ledger["peak"] == ledger["accelerator_api_peak"] == 8.0


def test_data_setter_takes_the_new_values_and_memory(seen):
    # The DeepSpeed trap: without it a write to the flat buffer would not reach the parameter.
    assert seen["data_setter"] == {"values": [2.0, 2.0], "still_param": True, "freed_mib": 4.0}


def test_moving_a_module_keeps_its_parameter_objects_as_cuda_does(seen):
    # the same objects (weakrefs to them included), with their own attributes, stepped by the optimizer
    assert seen["module_to_keeps_parameters"] == {
        "same_objects": True,
        "attribute_kept": True,
        "device": "fakegpu:0",
        "stepped": True,
    }


def test_deepcopy_makes_an_independent_device_module_and_counts_it(seen):
    assert seen["deepcopy_of_a_module"] == {
        "param": True,
        "device": "fakegpu:0",
        "independent": True,
        "added_mib": 1.0,
    }


def test_in_place_metadata_ops_reshape_the_device_tensor(seen):
    assert seen["in_place_metadata_ops"] == {
        "set_": [[2, 3], [[102.0, 103.0, 104.0], [105.0, 106.0, 107.0]]],  # a view of flat's values
        "set_added_bytes": 0,  # flat's storage, counted once
        "resize_": [3, 3],
        "squeeze_": [3],
        "shared_storage": True,
    }


def test_streams_and_events(seen):
    assert seen["streams_and_events"] == {"elapsed_ms_ok": True, "stream_device": "fakegpu:0"}


def test_phases_are_timed_by_the_devices_events(seen):
    assert seen["phases_timed_by_device_events"] == {"device_clock": True, "timed": True}


def test_adamw_steps_with_its_foreach_kernels_as_on_a_gpu(seen):
    # m and v (1 MiB each) and one sqrt(v) for all parameters (1 MiB): the foreach path a GPU takes;
    # the per-tensor path would hold a second temporary (sqrt(v), then its quotient)
    assert seen["adamw_step_memory"] == 3.0


def test_deepspeeds_typed_tensors_are_made_on_the_device_as_cudas_are(seen):
    assert seen["deepspeed_typed_tensors"] == [
        "torch.uint8@fakegpu:0",
        "torch.float32@fakegpu:0",
        "torch.int64@fakegpu:0",
    ]
