"""The gated delta rule (Gated DeltaNet linear attention: Qwen3-Next, Qwen3.5): torch references.
The Triton kernels (kernels.triton.gated_delta_decode / gated_delta_prefill) test against these.

Per value head, state S ``[Dk, Dv]`` float32 (fla's layout; llama.cpp keeps its transpose,
``[Dv][Dk]`` with the key index innermost), for each token t:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = scale * S_t^T q_t

the exact form of fla's ``fused_recurrent_gated_delta_rule`` (the decay applied to the state
before the prediction S^T k, the output read from the updated state) and of llama.cpp's
``build_delta_net_autoregressive`` (``S *= exp(g)``, ``d = beta (v - S^T k)``, ``S += k d^T``,
``o = S^T q``). g <= 0 is the log decay (the caller's ``-exp(A_log) softplus(a + dt_bias)``),
beta in (0, 1) (after the sigmoid), q and k l2-normalized by the caller. ``scale`` is applied to
the output here (1/sqrt(Dk) in both models; llama.cpp scales q, the same product).

Layout: tokens first, ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g, beta [T, Hv]``,
``o [T, Hv, Dv]`` (fla's ``[B, T, H, D]`` with B folded into T; a row of a projection's output
is one token). Hk divides Hv; value head h reads key head ``h // (Hv // Hk)`` ("grouped":
Qwen3-Next, fla's GVA) or ``h % Hk`` ("tiled": llama.cpp's qwen35, whose converter reorders the
value heads so that ``ggml_repeat`` can tile the key heads).

``chunked_reference`` is the WY form of fla's ``chunk_gated_delta_rule`` on chunks of C tokens
(G = the cumulative log decay inside the chunk, S_0 the state at its start):

    A = strict_lower(beta_i k_i.k_j exp(G_i - G_j)),  T = (I + A)^-1
    W = T (beta exp(G) K),  U = T (beta V),  V' = U - W S_0        (V': the chunk's deltas)
    O = scale (exp(G) Q S_0 + lower(Q K^T exp(G_i - G_j)) V')
    S_C = exp(G_C) S_0 + (exp(G_C - G) K)^T V'
"""

from __future__ import annotations

import torch

HEAD_MAPS = ("grouped", "tiled")


def key_head_index(n_v: int, n_k: int, head_map: str) -> torch.Tensor:
    """The key head each of the n_v value heads reads (int64 ``[n_v]``)."""
    if head_map not in HEAD_MAPS:
        raise ValueError(f"gated delta: head_map {head_map!r} not one of {HEAD_MAPS}")
    if n_k < 1 or n_v % n_k:
        raise ValueError(f"gated delta: {n_k} key heads do not divide {n_v} value heads")
    h = torch.arange(n_v)
    return h // (n_v // n_k) if head_map == "grouped" else h % n_k


def _check(q, k, v, g, beta, state):
    t, n_k, dk = q.shape
    _, n_v, dv = v.shape
    if k.shape != q.shape or v.shape[0] != t or g.shape != (t, n_v) or beta.shape != (t, n_v):
        raise ValueError(f"gated delta: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} disagree")  # fmt: skip
    if state is not None and state.shape != (n_v, dk, dv):
        raise ValueError(f"gated delta: state {tuple(state.shape)} is not [{n_v}, {dk}, {dv}]")
    return t, n_k, n_v, dk, dv


def naive_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, scale: float, state: torch.Tensor | None = None,
                    head_map: str = "grouped", dtype: torch.dtype = torch.float32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token, in ``dtype`` (float32, or float64 as the oracle).
    Shapes as the module says; ``state [Hv, Dk, Dv]`` (None: zeros), not modified. Returns
    (o ``[T, Hv, Dv]``, final state ``[Hv, Dk, Dv]``), both in ``dtype``."""
    t, n_k, n_v, dk, dv = _check(q, k, v, g, beta, state)
    kh = key_head_index(n_v, n_k, head_map)
    q, k = q.to(dtype)[:, kh], k.to(dtype)[:, kh]  # [T, Hv, Dk]
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    s = torch.zeros(n_v, dk, dv, dtype=dtype) if state is None else state.to(dtype).clone()
    o = torch.empty(t, n_v, dv, dtype=dtype)
    for i in range(t):
        s = s * g[i].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[i], s)
        delta = beta[i][:, None] * (v[i] - pred)
        s = s + k[i][:, :, None] * delta[:, None, :]
        o[i] = scale * torch.einsum("hk,hkv->hv", q[i], s)
    return o, s


def chunked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, scale: float, state: torch.Tensor | None = None,
                      head_map: str = "grouped", chunk: int = 64,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result by the WY form, ``chunk`` tokens at a time (the last chunk short).
    Arguments and returns as ``naive_reference``."""
    t, n_k, n_v, dk, dv = _check(q, k, v, g, beta, state)
    kh = key_head_index(n_v, n_k, head_map)
    q, k = q.to(dtype)[:, kh].transpose(0, 1), k.to(dtype)[:, kh].transpose(0, 1)  # [Hv, T, Dk]
    v = v.to(dtype).transpose(0, 1)  # [Hv, T, Dv]
    g, beta = g.to(dtype).t(), beta.to(dtype).t()  # [Hv, T]
    s = torch.zeros(n_v, dk, dv, dtype=dtype) if state is None else state.to(dtype).clone()
    o = torch.empty(n_v, t, dv, dtype=dtype)
    for c0 in range(0, t, chunk):
        sl = slice(c0, min(c0 + chunk, t))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        gc = g[:, sl].cumsum(-1)  # G, [Hv, C]
        n = gc.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        decay = torch.where(lower, (gc[:, :, None] - gc[:, None, :]).clamp(max=0).exp(), 0)
        a = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        tinv = torch.linalg.inv(torch.eye(n, dtype=dtype) + a)
        w = tinv @ ((bc * gc.exp())[:, :, None] * kc)
        u = tinv @ (bc[:, :, None] * vc)
        vnew = u - w @ s
        o[:, sl] = scale * (gc.exp()[:, :, None] * (qc @ s)
                            + ((qc @ kc.transpose(-1, -2)) * decay) @ vnew)
        g_last = gc[:, -1]
        s = g_last.exp()[:, None, None] * s + ((g_last[:, None] - gc).exp()[:, :, None] * kc).transpose(-1, -2) @ vnew
    return o.transpose(0, 1), s
