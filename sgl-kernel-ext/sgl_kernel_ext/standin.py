"""The ``sgl_kernel`` stand-in module: implemented CPU ops, and loud stubs for everything else.

SGLang imports names from ``sgl_kernel`` at module level even on its torch_native CPU path. Here those
names resolve to either a torch implementation from :mod:`sgl_kernel_ext.cpu_ops` or a stub that raises
``NotImplementedError`` naming the op when called — never a silent fake result. The module says what
it is through ``__sgl_kernel_ext_standin__ = True``.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict


class StandinOpError(NotImplementedError):
    """An ``sgl_kernel`` op was called that the CPU stand-in does not implement."""


def _stub(qualname: str) -> Callable[..., Any]:
    def op(*args, **kwargs):
        raise StandinOpError(
            f"{qualname} is not implemented by the sgl-kernel-ext CPU stand-in (no real sgl_kernel "
            "could load on this machine); use a CPU path that does not need it"
        )

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    op.__sgl_kernel_ext_stub__ = True
    return op


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        impl = _implemented().get(f"{self.__name__}.{name}")
        value = impl if impl is not None else _stub(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _implemented() -> Dict[str, Callable[..., Any]]:
    from sgl_kernel_ext import cpu_ops

    return cpu_ops.IMPLEMENTED


def make_module(name: str) -> types.ModuleType:
    mod = _StandinModule(name)
    mod.__path__ = []  # a package, so ``sgl_kernel.<sub>`` imports resolve through the finder too
    mod.__sgl_kernel_ext_standin__ = True
    mod.__version__ = "0.0.0+sgl-kernel-ext-standin"
    return mod


def populate(module: types.ModuleType) -> None:
    """Register the torch.library ops SGLang reaches through ``torch.ops.sgl_kernel``."""
    if module.__name__ == "sgl_kernel":
        from sgl_kernel_ext import cpu_ops

        cpu_ops.register_torch_ops()
