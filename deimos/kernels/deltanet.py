"""Gated DeltaNet reference math (torch): the short causal convolution and the gated delta rule,
as llama.cpp 11434 computes them (ggml_ssm_conv; delta-net-base.cpp and ggml's
gated_delta_net op, the scalar-gate "GDA" form).

Shapes: T tokens of ONE sequence, H heads (value heads; q/k already expanded to H), Dk key
width, Dv value width, C channels, K the kernel width. The state of a head is S [Dv, Dk]
(ggml keeps it as [S_v, S_v, H] with ne0 = the key index, the same memory).

Per token t (the recurrence; the naive oracle below):
    S   = exp(g_t) * S                      g_t <= 0 in real models: the log decay
    u   = beta_t * (v_t - S k_t)            beta_t in (0, 1)
    S   = S + u k_t^T
    o_t = S (scale * q_t)

The chunked form (WY form, as llama.cpp's build_delta_net_chunking and fla's
chunk_gated_delta_rule): inside a chunk of C tokens with cumulative log decay G_i = sum_{j<=i} g_j,
gamma_i = exp(G_i) and L[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i,
    U   = (I + L)^-1 (beta V - diag(beta gamma) K S0^T)           [C, Dv] the new values
    O   = diag(gamma) Q S0^T + (Q K^T * exp(G_i - G_j), j <= i) U
    S_C = gamma_C S0 + U^T diag(exp(G_C - G)) K
The last chunk is padded with g = beta = k = v = 0 tokens, which change nothing.
"""

from __future__ import annotations

import torch


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml_ssm_conv over one sequence with its carried inputs.

    x [T, C] float, weight [C, K] (ggml's ssm_conv1d [K, C]), state [K - 1, C]: the previous
    K - 1 inputs (zeros at the start of a sequence). Returns (y [T, C], new state [K - 1, C]):
    y[t, c] = sum_k xin[t + k, c] * weight[c, k] with xin = cat(state, x); the new state is
    the last K - 1 rows of xin. No activation (the model applies SiLU)."""
    if x.ndim != 2 or weight.ndim != 2 or state.ndim != 2:
        raise ValueError(f"causal_conv1d: want x [T, C], weight [C, K], state [K-1, C]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(state.shape)}")
    n, c = x.shape
    kw = weight.shape[1]
    if weight.shape[0] != c or tuple(state.shape) != (kw - 1, c):
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)} and "
                         f"state {tuple(state.shape)} disagree (want weight [C, K], state [K-1, C])")
    xin = torch.cat((state.to(x.dtype), x), dim=0)  # [T + K - 1, C]
    w = weight.to(x.dtype)
    y = xin[0:n] * w[:, 0]
    for k in range(1, kw):
        y = y + xin[k : k + n] * w[:, k]
    return y, xin[n:].clone()


def _check(q, k, v, g, beta, state) -> None:
    if q.ndim != 3 or q.shape != k.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"delta rule: want q, k [T, H, Dk] and v [T, H, Dv]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    n, h, dk = q.shape
    if g.shape != (n, h) or beta.shape != (n, h):
        raise ValueError(f"delta rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [T, H] = "
                         f"[{n}, {h}]")
    if state.shape != (h, v.shape[2], dk):
        raise ValueError(f"delta rule: state {tuple(state.shape)} must be [H, Dv, Dk] = "
                         f"[{h}, {v.shape[2]}, {dk}]")


def gated_delta_rule_recurrent(q, k, v, g, beta, state, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive recurrence, one token at a time (the oracle; ggml's gated_delta_net op).

    q, k [T, H, Dk]; v [T, H, Dv]; g (log decay), beta [T, H]; state [H, Dv, Dk]; all float32
    (float64 stays float64). Returns (o [T, H, Dv], new state [H, Dv, Dk]); inputs unchanged."""
    _check(q, k, v, g, beta, state)
    s = state.clone()
    out = q.new_empty(v.shape)
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", s, k[t]))
        s = s + u[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", s, q[t] * scale)
    return out, s


def gated_delta_rule_chunked(q, k, v, g, beta, state, scale: float,
                             chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form of ``gated_delta_rule_recurrent``: same arguments and results,
    ``chunk`` tokens at a time (llama.cpp: 64), the in-chunk system solved by a unit lower
    triangular solve."""
    _check(q, k, v, g, beta, state)
    if chunk < 1:
        raise ValueError(f"gated_delta_rule_chunked: chunk must be >= 1, got {chunk}")
    n, h = q.shape[:2]
    pad = -n % chunk
    def heads_first(x):  # [T, H, ...] -> [H, n_chunks, chunk, ...], padded with zeros
        x = torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, 0, 0, pad))
        return x.view(-1, chunk, *x.shape[1:]).movedim(2, 0)
    qc, kc, vc = heads_first(q * scale), heads_first(k), heads_first(v)
    gc, bc = heads_first(g), heads_first(beta)  # [H, N, C]
    s = state.clone()
    out = q.new_empty((h, qc.shape[1], chunk, v.shape[2]))
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    for c in range(qc.shape[1]):
        qi, ki, vi, bi = qc[:, c], kc[:, c], vc[:, c], bc[:, c]
        gcs = torch.cumsum(gc[:, c], dim=-1)  # [H, C]
        diff = gcs[:, :, None] - gcs[:, None, :]  # G_i - G_j
        decay = torch.exp(torch.where(lower, diff, torch.zeros_like(diff))) * lower
        gamma = torch.exp(gcs)
        kk = ki @ ki.transpose(1, 2)  # [H, C, C]
        lmat = bi[:, :, None] * kk * decay * strict
        rhs = bi[:, :, None] * vi - (bi * gamma)[:, :, None] * (ki @ s.transpose(1, 2))
        u = torch.linalg.solve_triangular(lmat + eye, rhs, upper=False, unitriangular=True)
        qk = (qi @ ki.transpose(1, 2)) * decay
        out[:, c] = gamma[:, :, None] * (qi @ s.transpose(1, 2)) + qk @ u
        tail = torch.exp(gcs[:, -1:] - gcs)  # exp(G_C - G_j)
        s = gamma[:, -1, None, None] * s + u.transpose(1, 2) @ (tail[:, :, None] * ki)
    out = out.reshape(h, -1, v.shape[2])[:, :n].transpose(0, 1).contiguous()
    return out, s


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml's build_gdn_l2_norm over the last dim: rms_norm(x, eps / n) / sqrt(n) = x / sqrt(sum
    x^2 + eps)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_gates(b: torch.Tensor, alpha: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, g) [T, Hv] of the projections b, alpha [T, Hv]: beta = sigmoid(b), g =
    softplus(alpha + dt_bias) * a (ssm_a = -exp(A_log): the log decay)."""
    return torch.sigmoid(b), torch.nn.functional.softplus(alpha + dt_bias) * a
