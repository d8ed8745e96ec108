"""A last-resort import finder that serves the ``sgl_kernel`` stand-in.

It is appended to the *end* of ``sys.meta_path``, so it is consulted only when no other finder found
``sgl_kernel``: a real, installed sgl_kernel always wins and is never shadowed, and once it is loaded the finder
serves none of its submodules either (a name the real package lacks stays an ImportError). Set
``SGL_KERNEL_EXT_DISABLE=1`` to turn the stand-in off entirely.

``python -m sgl_kernel_ext.finder install`` writes a ``.pth`` file into site-packages so the finder is
active in every interpreter of the environment (SGLang's subprocesses included).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "sgl_kernel_ext_standin.pth"
ROOT = "sgl_kernel"
# Submodules SGLang imports inside try/except with its own pure-Python fallback: the stand-in must *not*
# provide them, so that the fallback runs (found by starting the CPU server).
ABSENT = {"sgl_kernel.scalar_type"}


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec):
        from sgl_kernel_ext import standin

        return standin.make_module(spec.name)

    def exec_module(self, module):
        from sgl_kernel_ext import standin

        standin.populate(module)


class StandinFinder(importlib.abc.MetaPathFinder):
    """Finds ``sgl_kernel`` and ``sgl_kernel.*`` only after every real finder declined."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        if fullname in ABSENT or os.environ.get("SGL_KERNEL_EXT_DISABLE") == "1":
            return None
        root = sys.modules.get(ROOT)
        if fullname != ROOT and root is not None and not getattr(root, "__sgl_kernel_ext_standin__", False):
            # the real sgl_kernel is loaded (a GPU install): a submodule or op it lacks must stay an ImportError,
            # which SGLang's try/except fallbacks expect, not become a stand-in that fails when called
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandinLoader(), is_package=True)


# SGLang's CLI choices module: when it is imported, ``--attention-backend spex_cpu`` becomes a valid choice.
# This must happen before argument parsing, which in our launcher's process precedes plugin loading.
CHOICES_MODULE = "sglang.srt.arg_groups.choices"


class _AfterExecLoader(importlib.abc.Loader):
    def __init__(self, inner, after):
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            self._after(module)
        except Exception:  # never break SGLang's import for an optional extra choice
            pass


class ChoicesHookFinder(importlib.abc.MetaPathFinder):
    """Runs :func:`_add_backend_choice` right after SGLang's choices module executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != CHOICES_MODULE or os.environ.get("SGL_KERNEL_EXT_DISABLE") == "1":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AfterExecLoader(spec.loader, _add_backend_choice)
                return spec
        return None


def _add_backend_choice(module) -> None:
    from sgl_kernel_ext.attention import BACKEND_NAME

    if BACKEND_NAME not in module.ATTENTION_BACKEND_CHOICES:
        module.add_attention_backend_choices([BACKEND_NAME])


def activate() -> None:
    """Append the stand-in finder to ``sys.meta_path``, prepend the choices hook (idempotent)."""
    if not any(isinstance(f, StandinFinder) for f in sys.meta_path):
        sys.meta_path.append(StandinFinder())
    if not any(isinstance(f, ChoicesHookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, ChoicesHookFinder())


def is_standin(module) -> bool:
    return bool(getattr(module, "__sgl_kernel_ext_standin__", False))


def install() -> Path:
    """Write the ``.pth`` hook into this environment's site-packages."""
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    pth.write_text("import sgl_kernel_ext.finder as _f; _f.activate()\n")
    return pth


def main() -> None:
    if sys.argv[1:] == ["install"]:
        print(install())
    elif sys.argv[1:] == ["uninstall"]:
        pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
        pth.unlink(missing_ok=True)
        print(f"removed {pth}")
    else:
        raise SystemExit("usage: python -m sgl_kernel_ext.finder install|uninstall")


if __name__ == "__main__":
    main()
