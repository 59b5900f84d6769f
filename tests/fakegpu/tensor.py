"""Tensors on the emulated device: a wrapper subclass whose values live in a CPU tensor, and the
device's allocation and copy kernels.

Every op on a device tensor comes to `FakeGpuTensor.__torch_dispatch__`, which checks placement as
a CUDA kernel does - a CPU tensor among its arguments is refused with CUDA's message, except a 0-dim
one the op only reads (a scalar, which CUDA's kernels take) and CPU index tensors - runs the op on the
CPU values and wraps the results on the device. Functional collectives run on the device tensors
themselves: the device's process group takes them. Only copies cross devices: `copy_`, `_to_copy`
(`.to`, `.cpu()`, which returns a plain CPU tensor) and `_copy_from`.

C++ code (DDP's reducer, FSDP2, `torch.empty(..., device=...)`, `.to(device)`) allocates through
`aten::empty.memory_format` and `aten::empty_strided` for PrivateUse1, registered here.
"""

from __future__ import annotations

import copy

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tests.fakegpu.device import DEVICE_TYPE, on_index
from tests.fakegpu.ledger import LEDGER

aten = torch.ops.aten
CPU = torch.device("cpu")
_DATA = torch._C.TensorBase.__dict__["data"]  # the C++ `.data` (metadata; a fresh version counter)
# Ops whose CPU index tensors CUDA accepts (it moves them to the device itself).
_CPU_INDICES_ACCEPTED = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"}


class FakeGpuTensor(torch.Tensor):
    """A tensor on the emulated device; `_elem` is the CPU tensor holding its values."""

    _elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=device,
        )
        wrapper._point_at(elem)
        return wrapper

    def _point_at(self, elem: torch.Tensor) -> None:
        self._elem = elem
        self._counted = LEDGER.hold(elem.untyped_storage(), self.device.index)

    def _follow_values(self) -> None:
        """After an in-place op that changed the values' shape or storage (set_, resize_, squeeze_,
        ...): the wrapper's own sizes and strides follow, set as the C++ `.data` setter sets them,
        and the ledger counts the new storage."""
        elem = self._elem
        if (self.shape, self.stride(), self.storage_offset()) != (
            elem.shape,
            elem.stride(),
            elem.storage_offset(),
        ):
            _DATA.__set__(self, FakeGpuTensor(elem, self.device))
        storage = elem.untyped_storage()
        if self._counted.holds(storage):
            LEDGER.resized(storage)  # resize_ grows a storage in place
        else:
            self._counted.release()
            self._point_at(elem)

    def untyped_storage(self) -> torch.UntypedStorage:
        # The values' storage (its device says cpu): views share it and `set_` takes it, as with a
        # device storage (TensorDict rebuilds a batch's tensors over one moved buffer so).
        return self._elem.untyped_storage()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # DeepSpeed points `param.data` at views of its flat buffers: without taking the values too,
        # ZeRO 1/2 would step those buffers and leave every weight unchanged, without an error.
        _DATA.__set__(self, new)
        self._counted.release()
        self._point_at(new._elem)

    def tolist(self):
        return self._elem.tolist()  # torch refuses tensor subclasses; CUDA's copies to the host

    def numpy(self, *, force: bool = False):
        if force:
            return self.cpu().numpy(force=True)
        raise TypeError(  # CUDA's words
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
            "to host memory first."
        )

    def __repr__(self) -> str:
        return f"{self._elem!r} on {self.device}"

    def __deepcopy__(self, memo):
        # Tensor.__deepcopy__ would deep-copy __dict__, values and ledger handle included, over the
        # clone it makes: a second copy of the values, uncounted, and a handle to the original's count.
        if id(self) in memo:
            return memo[id(self)]
        twin = FakeGpuTensor(copy.deepcopy(self._elem, memo), self.device).requires_grad_(self.requires_grad)
        memo[id(self)] = twin
        if self.grad is not None:
            twin.grad = copy.deepcopy(self.grad, memo)
        extra = {k: v for k, v in self.__dict__.items() if k not in ("_elem", "_counted")}  # e.g. _is_param
        twin.__dict__.update(copy.deepcopy(extra, memo))
        return twin

    def __reduce_ex__(self, protocol):
        # Values saved as a CPU tensor's are, with the device: see `_rebuild`.
        return _rebuild, (self._elem, str(self.device), self.requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _COPIES:
            return _COPIES[func](func, *args, **kwargs)
        if func.namespace == "_c10d_functional":
            return _below_python(func, args, kwargs)
        device = _placement(func, args, kwargs)
        out = func(*_on_cpu(args), **_on_cpu(kwargs))
        return _back(out, (args, kwargs), device)


def _below_python(func, args, kwargs):
    """A functional collective (DTensor's, FSDP2's) run by its own kernel on the device tensors
    themselves: it calls the device's process group, which wants them, not their CPU values."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        return func(*args, **kwargs)


def _rebuild(values: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    """torch.load's rebuild of a device tensor: on its device, or where map_location sends it, as a
    CUDA tensor's load does. A callable map_location gets the values' storage and the device's name;
    what it returns says the device (DeepSpeed loads checkpoints with `lambda storage, loc: storage`,
    which keeps a GPU checkpoint's tensors on the CPU)."""
    location = torch.serialization._serialization_tls.map_location
    if callable(location):
        restored = location(values.untyped_storage(), device)
        target = torch.device(device) if restored is None else restored.device
    elif isinstance(location, dict):
        target = torch.device(location.get(device, device))
    else:
        target = torch.device(device if location is None else location)
    tensor = values.to(target)
    tensor.requires_grad = requires_grad
    return tensor


def to_device(elem: torch.Tensor, device: torch.device | str | None = None) -> FakeGpuTensor:
    """The device tensor whose values are `elem` (a CPU tensor, not copied)."""
    return FakeGpuTensor(elem, on_index(device))


def _is_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE_TYPE


def _on_cpu(tree):
    """`tree` with each device tensor replaced by its values and each device by the CPU."""

    def unwrap(x):
        if isinstance(x, FakeGpuTensor):
            return x._elem
        if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
            return CPU
        return x

    return tree_map(unwrap, tree)


def _back(out, inputs, device: torch.device | None):
    """The op's results on `device` (None: left on the CPU, as asked); a result that is an input
    (in-place and out= ops) is that input."""
    leaves, _ = tree_flatten(inputs)
    same = {
        id(t._elem if isinstance(t, FakeGpuTensor) else t): t for t in leaves if isinstance(t, torch.Tensor)
    }

    def wrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in same:
            mutated = same[id(x)]
            if isinstance(mutated, FakeGpuTensor):
                mutated._follow_values()
            return mutated
        return x if device is None else FakeGpuTensor(x, device)

    return tree_map(wrap, out)


def _tensor_arguments(func, args, kwargs):
    """(schema argument, tensor) for every tensor the op is given, lists included."""
    schema = func._schema.arguments
    by_name = {a.name: a for a in schema}
    given = list(zip(schema, args)) + [(by_name[name], value) for name, value in kwargs.items()]
    for argument, value in given:
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                yield argument, leaf


def _placement(func, args, kwargs) -> torch.device | None:
    """The device the op's results go to, after CUDA's placement checks: all device tensors on one
    device, no CPU tensor beside them but a scalar it reads."""
    given = list(_tensor_arguments(func, args, kwargs))
    devices = sorted({t.device for _, t in given if isinstance(t, FakeGpuTensor)}, key=str)
    if len(devices) > 1:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{devices[0]} and {devices[1]}!"
        )
    for argument, t in given:
        if _refused_on_cpu(func, argument, t):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but got {argument.name} is on cpu, "
                f"different from other tensors on {devices[0]} (when checking argument in method {func})"
            )
    asked = kwargs.get("device")
    if asked is not None:
        return on_index(asked) if _is_device(asked) else None
    return devices[0] if devices else None


def _refused_on_cpu(func, argument, t: torch.Tensor) -> bool:
    if isinstance(t, FakeGpuTensor) or t.device.type != "cpu":
        return False
    if t.dim() == 0:  # a CPU scalar: a device op may read it (CUDA's kernels take it), not write it
        return argument.alias_info is not None and argument.alias_info.is_write
    return not (argument.name == "indices" and func.overloadpacket.__name__ in _CPU_INDICES_ACCEPTED)


# -- the ops that cross devices -------------------------------------------------------------------
def _to_copy(func, src, **kwargs):
    target = kwargs.get("device", src.device)
    out = func(_on_cpu(src), **_on_cpu(kwargs))
    return FakeGpuTensor(out, on_index(target)) if _is_device(target) else out


def _copy_(func, dst, src, *non_blocking, **kwargs):
    func(_on_cpu(dst), _on_cpu(src), *non_blocking, **kwargs)
    return dst


def _copy_from(func, src, dst, *non_blocking, **kwargs):
    _on_cpu(dst).copy_(_on_cpu(src), *non_blocking, **kwargs)
    return dst


_COPIES = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._copy_from.default: _copy_from,
}


# -- the device's kernels, for callers that allocate or copy below the Python dispatcher ------------
def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    elem = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format)
    return FakeGpuTensor(elem, on_index(device))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return FakeGpuTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout), on_index(device))


def _copy_from_kernel(src, dst, non_blocking=False):
    return _copy_from(aten._copy_from.default, src, dst, non_blocking=non_blocking)


_kernels: torch.library.Library | None = None


def register_kernels() -> None:
    global _kernels
    if _kernels is None:
        torch.serialization.add_safe_globals([_rebuild])  # torch.load's weights_only default
        _kernels = torch.library.Library("aten", "IMPL")
        _kernels.impl("empty.memory_format", _empty, "PrivateUse1")
        _kernels.impl("empty_strided", _empty_strided, "PrivateUse1")
        _kernels.impl("_copy_from", _copy_from_kernel, "PrivateUse1")


def take_foreach_paths() -> None:
    """torch's optimizers and clip_grad_norm_ take their foreach kernels, as on CUDA, only for tensors
    of a listed type (`_foreach_supported_types` of torch/optim/optimizer.py and of
    torch/utils/_foreach_utils.py; DTensor adds itself so): list the device's, so that an optimizer
    step holds the temporaries it holds on a GPU (AdamW: one sqrt(v) a state, where its per-tensor
    path holds two)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if FakeGpuTensor not in supported:
            supported.append(FakeGpuTensor)
