"""The reference of the device-host handshake (deimos.kernels.triton.host_link): what
``post_rows`` and ``wait_rows`` leave in memory, as torch copies (no ordering: one thread)."""

from __future__ import annotations

import torch


def post_rows_reference(ids, weights, x, box_ids, box_w, box_x, flag, seq, bump: bool) -> None:
    t = ids.shape[0]
    box_ids[:t].copy_(ids)
    box_w[:t].copy_(weights)
    box_x[:t].copy_(x)
    if bump:
        seq += 1
    flag.copy_(seq)


def wait_rows_reference(flag, seq, err, src, out, layer: int) -> torch.Tensor:
    if int(flag[0]) - int(seq[0]) < 0:  # the host never answered (the kernel: after its polls,
        err.fill_(layer + 1)  # or at once when an earlier layer gave up)
    out.copy_(src[: out.shape[0]])
    return out
