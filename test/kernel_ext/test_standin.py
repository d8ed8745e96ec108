"""The sgl_kernel stand-in: implemented ops match references, others raise naming the op, never shadows."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from sgl_kernel_ext.cpu_ops import murmur_hash32_cpu
from sgl_kernel_ext.standin import StandinOpError


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Textbook MurmurHash3_x86_32 over whole 4-byte blocks."""
    c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = (k * c1) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * c2) & m
        h ^= k
        h = ((h << 13) | (h >> 19)) & m
        h = (h * 5 + 0xE6546B64) & m
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_murmur_matches_textbook():
    seeds = torch.tensor([0, 1, 42, 2**40 + 7, 2**62 - 1])
    pos = torch.tensor([0, 3, 17, 1000, 2**31 - 1])
    cols = torch.tensor([0, 1, 2, 511, 49151])
    got = murmur_hash32_cpu(seeds, pos, cols)
    assert got.dtype == torch.uint32 and got.shape == (5, 5)
    for i, (s, p) in enumerate(zip(seeds.tolist(), pos.tolist())):
        for j, c in enumerate(cols.tolist()):
            key = struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p, c)
            assert int(got[i, j]) == murmur3_x86_32(key)


def test_torch_op_registered_through_standin():
    import sgl_kernel

    assert sgl_kernel.__sgl_kernel_ext_standin__ is True
    out = torch.ops.sgl_kernel.murmur_hash32_cpu.default(torch.tensor([5]), torch.tensor([2]), torch.arange(3))
    assert torch.equal(out, murmur_hash32_cpu(torch.tensor([5]), torch.tensor([2]), torch.arange(3)))


def test_unimplemented_op_raises_naming_it():
    from sgl_kernel import some_fused_kernel_xyz
    from sgl_kernel.kvcacheio import transfer_kv_xyz

    with pytest.raises(StandinOpError, match="sgl_kernel.some_fused_kernel_xyz"):
        some_fused_kernel_xyz(torch.zeros(1))
    with pytest.raises(NotImplementedError, match="sgl_kernel.kvcacheio.transfer_kv_xyz"):
        transfer_kv_xyz()


def test_fallback_submodule_is_absent():
    with pytest.raises(ImportError):
        from sgl_kernel.scalar_type import scalar_types  # noqa: F401


def test_never_shadows_a_real_sgl_kernel(tmp_path):
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    code = textwrap.dedent("""
        import sgl_kernel
        print(getattr(sgl_kernel, "REAL", False), getattr(sgl_kernel, "__sgl_kernel_ext_standin__", False))
        """)
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True
    )
    assert out.stdout.split() == ["True", "False"], out.stderr
    off = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel"], env={"SGL_KERNEL_EXT_DISABLE": "1"}, capture_output=True, text=True
    )
    assert off.returncode != 0 and "No module named 'sgl_kernel'" in off.stderr


def test_a_name_the_real_sgl_kernel_lacks_stays_an_import_error(tmp_path):
    """With the real package loaded (a GPU install), an op or submodule it lacks must raise ImportError, which
    SGLang's try/except fallbacks expect (e.g. ``from sgl_kernel import fused_qk_rope_with_cos_sin_cache_inplace``);
    the finder used to serve a stand-in module there, which failed only when called."""
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    code = textwrap.dedent("""
        import sgl_kernel
        for stmt in ("from sgl_kernel import some_missing_op", "import sgl_kernel.some_missing_submodule"):
            try:
                exec(stmt)
                print("imported")
            except ImportError:
                print("ImportError")
        """)
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True
    )
    assert out.stdout.split() == ["ImportError", "ImportError"], out.stdout + out.stderr
