"""Fixtures of the attention tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def triton_kernel(monkeypatch):
    """paged_decode_attention_triton on CPU tensors (TRITON_INTERPRET=1), with the interpreter's
    bf16 tl.dot fixed."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from nanoqwen.attention.backends import triton_paged as tpa

    if not isinstance(tpa._paged_decode_kernel, interpreter.InterpretedFunction):
        pytest.skip("the kernel module was imported before TRITON_INTERPRET=1 was set "
                    "(run this file alone)")
    # triton 3.9's interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits: widen
    # them to float32 first (exact), as the GPU's bf16 MMA does.
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        def widen(h):
            if h.dtype == tl.bfloat16:
                widened = (h.data.astype(np.uint32) << 16).view(np.float32)
                return interpreter.TensorHandle(widened, tl.float32)
            return h
        return original(self, widen(a), widen(b), d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    return tpa.paged_decode_attention_triton
