"""The ``spex_cpu`` attention backend and its registration with SGLang's attention-backend registry."""

from __future__ import annotations

BACKEND_NAME = "spex_cpu"
_registered = False


def register() -> None:
    """Make ``--attention-backend spex_cpu`` selectable (CLI choice + registry factory + draft-backend hooks).

    Idempotent; call it from a plugin's ``register()`` (HookRegistry hooks are applied after plugins load).
    """
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:

        @register_attention_backend(BACKEND_NAME)
        def _create(runner):
            from sgl_kernel_ext.attention.backend import SpexCpuAttnBackend

            return SpexCpuAttnBackend(runner)

    from sgl_kernel_ext.attention.draft import register_draft_hooks

    register_draft_hooks()  # EAGLE / EAGLE3 / STANDALONE draft backends for spex_cpu
    _registered = True
