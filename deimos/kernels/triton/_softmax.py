"""The online-softmax step shared by the decode and prefill attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(qk, b_v, m_i, l_i, acc):
    """Fold one tile of scores ``qk`` [M, N] (base 2, masked entries -inf) and its values
    ``b_v`` [N, D] into the running max ``m_i``, sum ``l_i`` and output ``acc``; returns them.
    A row with nothing visible yet keeps max -inf: it subtracts 0 instead (exp2(-inf) = 0)."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, out_dtype=tl.float32)
    return m_new, l_i, acc
