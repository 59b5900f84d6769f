"""Run in a fresh process by test_fakegpu.py, with the emulated accelerator installed at startup
(fakegpu.child_env): one process, two devices. Each check prints a `RESULT {json}` line with what it
saw; the test says what it must be."""

import copy
import io
import weakref

import torch

from tests.dist.workers.results import print_result

MIB = 1 << 20
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def error_of(fn) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


@check
def accelerator():
    torch.accelerator.set_device_index(1)
    selected = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(0)
    return {
        "type": torch.accelerator.current_accelerator(check_available=True).type,
        "count": torch.accelerator.device_count(),
        "backend": torch.distributed.get_default_backend_for_device("fakegpu"),
        "selected": selected,
        "unindexed_tensor": str(torch.ones(2, device="fakegpu").device),
    }


@check
def cpu_batch_into_device_module():
    model = torch.nn.Linear(4, 2).to("fakegpu")
    return error_of(lambda: model(torch.randn(3, 4)))


@check
def cpu_scalar_with_device_tensor():
    return str((torch.ones(3, device="fakegpu") * torch.tensor(2.0)).device)


@check
def device_tensor_into_cpu_scalar():
    """`cpu_total += device_value`, as a loss accumulated on the CPU: CUDA refuses it."""
    total = torch.zeros(())
    return error_of(lambda: total.add_(torch.ones((), device="fakegpu")))


@check
def two_devices_in_one_op():
    return error_of(lambda: torch.ones(2, device="fakegpu:0") + torch.ones(2, device="fakegpu:1"))


@check
def a_device_past_the_last():
    return error_of(lambda: torch.ones(2, device="fakegpu:2"))


@check
def cpu_indices():
    values = torch.arange(5.0, device="fakegpu")
    values[torch.tensor([0, 1])] = 9.0
    return values[torch.tensor([1, 4])].cpu().tolist()


@check
def moves():
    x = torch.randn(3)
    on_device = x.to("fakegpu:1")
    back = on_device.cpu()
    return {
        "to_device": str(on_device.device),
        "cpu_type": type(back).__name__,
        "to_cpu_type": type(on_device.to("cpu")).__name__,
        "cpu_device": str(back.device),
        "values_kept": torch.equal(back, x) and on_device.tolist() == x.tolist(),
        "dtype_change_stays": str(on_device.double().device),
        "numpy_refused": _numpy_refused(on_device),
    }


def _numpy_refused(t) -> str | None:
    try:
        t.numpy()
    except TypeError as e:
        return str(e)
    return None


@check
def autograd_on_device_1():
    x = torch.tensor([1.0, 2.0, 3.0], device="fakegpu:1", requires_grad=True)
    (x * x).sum().backward()
    return {"device": str(x.grad.device), "grad": x.grad.cpu().tolist()}


@check
def save_and_load():
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0, device="fakegpu:1")}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["w"]
    buffer.seek(0)
    mapped = torch.load(buffer, map_location="cpu")["w"]
    buffer.seek(0)
    kept_on_host = torch.load(buffer, map_location=lambda storage, loc: storage, weights_only=False)["w"]
    return {
        "device": str(loaded.device),
        "values": loaded.cpu().tolist(),
        "mapped": str(mapped.device),
        "callable_map_location": str(kept_on_host.device),  # DeepSpeed's load_checkpoint
    }


@check
def memory_ledger():
    """Allocated bytes on device 0 after each step of a small sequence (a 4 MiB tensor, a view of
    it, a product, deletions), as offsets from the start, and the peak."""
    torch.fakegpu.reset_peak_memory_stats(0)
    start = torch.fakegpu.memory_allocated(0)
    seen = []

    def note():
        seen.append((torch.fakegpu.memory_allocated(0) - start) / MIB)

    a = torch.zeros(MIB, device="fakegpu:0")  # fp32: 4 MiB
    note()
    view = a[: MIB // 2]
    note()
    product = a * 2
    note()
    del product
    note()
    del a
    note()  # the view still holds the storage
    del view
    note()
    on_other = torch.zeros(MIB, device="fakegpu:1")
    note()  # another device's memory
    del on_other
    torch.accelerator.empty_cache()  # the generic API answers too (runtime.dist releases memory with it)
    return {
        "steps": seen,
        "peak": (torch.fakegpu.max_memory_allocated(0) - start) / MIB,
        "accelerator_api_peak": (torch.accelerator.max_memory_allocated(0) - start) / MIB,
    }


@check
def data_setter():
    """`param.data = other` takes the other tensor's values and memory, as DeepSpeed relies on."""
    param = torch.nn.Parameter(torch.zeros(MIB, device="fakegpu"))
    flat = torch.ones(2 * MIB, device="fakegpu")
    before = torch.fakegpu.memory_allocated()
    param.data = flat[:MIB]
    flat.add_(1.0)  # a write to the buffer is a write to the parameter
    return {
        "values": param.cpu()[:2].tolist(),
        "still_param": isinstance(param, torch.nn.Parameter),
        "freed_mib": (before - torch.fakegpu.memory_allocated()) / MIB,
    }


@check
def module_to_keeps_parameters():
    """An optimizer made before `model.to(device)` still steps the model's parameters, as on CUDA."""
    model = torch.nn.Linear(4, 2)
    before = list(model.parameters())
    model.weight.tensor_model_parallel = True  # as megatron marks its parameters
    weak = weakref.ref(model.weight)  # as DeepSpeed and megatron hold some
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to("fakegpu")
    model(torch.ones(3, 4, device="fakegpu")).sum().backward()
    weight = model.weight.detach().cpu().clone()
    optimizer.step()
    return {
        "same_objects": all(a is b for a, b in zip(before, model.parameters())) and weak() is model.weight,
        "attribute_kept": getattr(model.weight, "tensor_model_parallel", False),
        "device": str(model.weight.device),
        "stepped": not torch.equal(weight, model.weight.detach().cpu()),
    }


@check
def deepcopy_of_a_module():
    """copy.deepcopy of a module on the device (as a reference model is made): parameters stay
    parameters on the device, with values of their own, counted once more."""
    model = torch.nn.Linear(1024, 256, bias=False).to("fakegpu")  # 1 MiB of weights
    before = torch.fakegpu.memory_allocated()
    twin = copy.deepcopy(model)
    twin.weight.data.add_(1.0)
    return {
        "param": isinstance(twin.weight, torch.nn.Parameter) and twin.weight.requires_grad,
        "device": str(twin.weight.device),
        "independent": not torch.equal(twin.weight.cpu(), model.weight.cpu()),
        "added_mib": (torch.fakegpu.memory_allocated() - before) / MIB,
    }


@check
def in_place_metadata_ops():
    """set_ over another device tensor's storage (TensorDict's consolidated `.to(device)` builds a
    batch so), resize_ and squeeze_: the device tensor's shape follows, and the ledger its storage."""
    flat = torch.arange(10.0, device="fakegpu")
    start = torch.fakegpu.memory_allocated()
    view = torch.empty(0, device="fakegpu").set_(flat.untyped_storage(), 2, (2, 3), (3, 1))
    flat.add_(100.0)
    grown = torch.zeros(2, device="fakegpu").resize_(3, 3)
    squeezed = torch.zeros(1, 3, device="fakegpu").squeeze_(0)
    return {
        "set_": [list(view.shape), view.cpu().tolist()],
        "set_added_bytes": torch.fakegpu.memory_allocated() - start - 36 - 12,  # minus grown, squeezed
        "resize_": list(grown.shape),
        "squeeze_": list(squeezed.shape),
        "shared_storage": view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(),
    }


@check
def streams_and_events():
    stream = torch.fakegpu.Stream(priority=-1)
    start, end = torch.fakegpu.Event(enable_timing=True), torch.fakegpu.Event(enable_timing=True)
    start.record()
    with torch.fakegpu.stream(stream):
        torch.ones(8, device="fakegpu").sum()
    stream.wait_stream(torch.fakegpu.current_stream())
    end.record()
    end.synchronize()
    return {"elapsed_ms_ok": start.elapsed_time(end) >= 0, "stream_device": str(stream.device)}


@check
def phases_timed_by_device_events():
    """runtime.phases on the emulated device: the phase clock is the device's (events on its stream,
    runtime/device_clock.py), and a phase that sleeps 50 ms on the host is timed within host bounds."""
    import time

    from runtime import phases

    phases.take_phase_times()
    host_started = time.perf_counter()
    with phases.phase("work"):
        torch.ones(64, 64, device="fakegpu").sum()
        time.sleep(0.05)
    host_s = time.perf_counter() - host_started
    work_s = phases.take_phase_times()["work"]
    return {"device_clock": phases.device_clock().device is torch.fakegpu, "timed": 0.05 <= work_s <= host_s}


@check
def adamw_step_memory():
    """Peak of an AdamW step on a 1 MiB (fp32) parameter over what it holds before the step (the
    parameter, its gradient): Adam's m and v, and the temporaries of the path torch takes."""
    param = torch.nn.Parameter(torch.zeros(MIB // 4, device="fakegpu"))
    param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW([param])
    before = torch.fakegpu.memory_allocated()
    torch.fakegpu.reset_peak_memory_stats()
    optimizer.step()
    return (torch.fakegpu.max_memory_allocated() - before) / MIB


@check
def deepspeed_typed_tensors():
    """The tensor types of DeepSpeed's accelerator (its overflow check all-reduces a ByteTensor)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    made = (accelerator.ByteTensor([1]), accelerator.FloatTensor([1.0]), accelerator.LongTensor([1]))
    return [f"{t.dtype}@{t.device}" for t in made]


if __name__ == "__main__":
    for name, fn in CHECKS.items():
        print_result({"check": name, "value": fn()})
