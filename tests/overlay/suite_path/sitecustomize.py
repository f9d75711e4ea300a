"""The runner's patches for upstream FastVideo's GPU-only Ulysses tests on CPU ranks
(``tests/overlay/upstream_suite.py`` puts this folder first on its runs' ``PYTHONPATH`` and sets
``FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS`` to the CPU-rank cap; without that variable this module does nothing). The
test files are never edited; the patches reach the ``torch.distributed.run`` children because they inherit
``PYTHONPATH`` and the variable:

* in every process, upstream's platform is resolved as on a CPU machine, and its PyNccl finds no NCCL library as
  there: its CUDA probe (NVML) would see a GPU host's GPUs, which the run hides from CUDA, and a PyNccl communicator
  built on a GPU host's NCCL library would bind the CPU device;
* in the pytest process (and torchrun's agent): ``torch.cuda.device_count()`` is the cap, so the tests' CUDA-count
  skip (``device_count() < world``) becomes a CPU-rank cap;
* in a test's worker (``python <test_ulysses_*.py> --worker``), the device choice: ``torch.device("cuda:N")`` is the
  CPU, ``torch.cuda.set_device`` does nothing, and upstream's CPU platform answers ``is_cuda_alike()`` (so its
  coordinator builds the CUDA communicator, which holds ``ulysses_a2a``; the CPU one has none) while the process
  groups it then asks for over NCCL are made over gloo (a CPU machine has no NCCL).

The python's own ``sitecustomize`` (shadowed by this one) is imported first.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKERS = ("test_ulysses_a2a_parity.py", "test_ulysses_fault_injection.py")


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the python has one."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _patch(cap: int) -> None:
    import torch

    # The run hides the GPUs (a CPU machine's run), but upstream's platform probe asks NVML, which still sees them.
    sys.meta_path.insert(0, _AfterImport("fastvideo.platforms", _no_cuda_platform))
    sys.meta_path.insert(0, _AfterImport("fastvideo.distributed.device_communicators.pynccl", _no_nccl_library))
    if "--worker" not in sys.argv[1:] or os.path.basename(sys.argv[0]) not in _WORKERS:
        torch.cuda.device_count = lambda: cap
        return
    real = torch.device

    class _Meta(type):  # isinstance(d, torch.device) still holds for every device
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, real)

    class device(metaclass=_Meta):  # torch's name, for messages
        def __new__(cls, *args, **kwargs):
            made = real(*args, **kwargs)
            return real("cpu") if made.type == "cuda" else made

    torch.device = device
    torch.cuda.set_device = lambda device: None
    for name in ("init_process_group", "new_group"):
        real_fn = getattr(torch.distributed, name)
        setattr(torch.distributed, name, _gloo_for_nccl(real_fn))
    sys.meta_path.insert(0, _AfterImport("fastvideo.platforms.cpu", _cuda_alike_cpu))


def _gloo_for_nccl(fn):
    def call(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return fn(*args, **kwargs)

    return call


def _no_cuda_platform(module) -> None:
    module.cuda_platform_plugin = lambda: None


def _no_nccl_library(module) -> None:
    def missing(*args, **kwargs):
        raise OSError("no NCCL library: a CPU-rank run (FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS)")

    module.NCCLLibrary = missing  # PyNcclCommunicator then disables itself, as on a machine without NCCL


def _cuda_alike_cpu(module) -> None:
    import torch

    module.CpuPlatform.is_cuda_alike = lambda self: True
    module.CpuPlatform.get_torch_device = classmethod(lambda cls: torch.cuda)  # its set_device: the no-op above


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once ``name`` is imported (whichever finder loads it)."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module) -> None:
                run(module)
                self.patch(module)

            spec.loader.exec_module = exec_module
        return spec


_chain()
if os.environ.get("FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS"):
    _patch(int(os.environ["FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS"]))
