"""The device-host handshake kernels (deimos.kernels.triton.host_link) against their reference
(deimos.kernels.host_link): rows copied into the host's mailbox and the step's number
published; the host's rows copied back once its flag carries the number; a wait that gives up
says so in the error word. Under the interpreter the host's flags are set before the launch
(programs run one after another); on the GPU a host thread answers while the kernel spins."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernel_device import DEVICE, INTERPRETED  # noqa: I001  (first: sets TRITON_INTERPRET)

from deimos.kernels.host_link import post_rows_reference, wait_rows_reference  # noqa: E402
from deimos.kernels.triton.host_link import post_rows, wait_rows  # noqa: E402

PIN = DEVICE == "cuda"


def _host(*shape, dtype=torch.float32) -> torch.Tensor:
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if PIN else t


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("t,k,d,bump", [(1, 8, 2048, True), (3, 4, 1500, False), (2, 6, 64, True)])
def test_post_rows_copies_the_rows_and_publishes_the_step(t, k, d, bump):
    g = torch.Generator().manual_seed(t * 100 + k)
    r = 4
    ids = torch.randint(0, 128, (t, k), generator=g, dtype=torch.int32)
    w = torch.rand(t, k, generator=g)
    x = torch.randn(t, d, generator=g)
    box = [_host(r, k, dtype=torch.int32), _host(r, k), _host(r, d)]
    flag = _host(1, dtype=torch.int32)
    seq = torch.tensor([41], dtype=torch.int32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    post_rows(ids.to(DEVICE), w.to(DEVICE), x.to(DEVICE), *box, flag, seq, count, bump)
    _sync()
    want = [torch.zeros_like(b) for b in box]
    wflag, wseq = torch.zeros(1, dtype=torch.int32), torch.tensor([41], dtype=torch.int32)
    post_rows_reference(ids, w, x, *want, wflag, wseq, bump)
    for got, ref in zip(box, want):
        assert torch.equal(got, ref)
    assert int(flag[0]) == int(wseq[0]) == (42 if bump else 41)
    assert int(seq.cpu()[0]) == int(wseq[0])
    assert int(count.cpu()[0]) == 0  # ready for the next launch (a graph replays it as it is)


def test_wait_rows_copies_the_host_rows_once_the_flag_is_there():
    src = _host(4, 300)
    src.copy_(torch.randn(4, 300, generator=torch.Generator().manual_seed(1)))
    flag, err = _host(1, dtype=torch.int32), _host(1, dtype=torch.int32)
    flag.fill_(7)
    seq = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    out = torch.full((3, 300), float("nan"), device=DEVICE)
    wait_rows(flag, seq, err, src, out, layer=5)
    _sync()
    want = wait_rows_reference(flag, seq.cpu(), torch.zeros(1, dtype=torch.int32), src,
                               torch.empty(3, 300), 5)
    assert torch.equal(out.cpu(), want) and int(err[0]) == 0


def test_a_wait_that_gives_up_says_which_layer():
    src = _host(2, 64)
    flag, err = _host(1, dtype=torch.int32), _host(1, dtype=torch.int32)
    flag.fill_(6)  # the host is one step behind
    seq = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 64, device=DEVICE)
    wait_rows(flag, seq, err, src, out, layer=3, max_spin=50)
    _sync()
    assert int(err[0]) == 4


def test_after_one_wait_gave_up_the_next_ones_do_not_spin():
    src = _host(1, 64)
    flag, err = _host(1, dtype=torch.int32), _host(1, dtype=torch.int32)
    err.fill_(3)  # layer 2 gave up
    seq = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    t0 = time.perf_counter()
    wait_rows(flag, seq, err, src, torch.empty(1, 64, device=DEVICE), layer=5, max_spin=1 << 30)
    _sync()
    assert time.perf_counter() - t0 < 60 and int(err[0]) == 6


@pytest.mark.skipif(INTERPRETED, reason="the kernel spins while a host thread answers: a GPU")
def test_the_kernel_waits_for_the_host_thread():
    src = _host(1, 2048)
    flag, err = _host(1, dtype=torch.int32), _host(1, dtype=torch.int32)
    seq = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(1, 2048, device=DEVICE)
    answer = torch.randn(1, 2048)

    def host():
        time.sleep(0.05)
        src.copy_(answer)
        flag.fill_(1)  # after the rows (x86 keeps the order of stores)

    th = threading.Thread(target=host)
    t0 = time.perf_counter()
    wait_rows(flag, seq, err, src, out, layer=0)
    th.start()
    torch.cuda.synchronize()
    th.join()
    assert time.perf_counter() - t0 >= 0.05
    assert torch.equal(out.cpu(), answer) and int(err[0]) == 0


def test_bad_buffers_are_named():
    ids = torch.zeros(1, 8, dtype=torch.int64, device=DEVICE)
    w, x = torch.zeros(1, 8, device=DEVICE), torch.zeros(1, 16, device=DEVICE)
    box = [_host(1, 8, dtype=torch.int32), _host(1, 8), _host(1, 16)]
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ids must be contiguous torch.int32"):
        post_rows(ids, w, x, *box, _host(1, dtype=torch.int32), one, one.clone(), True)
    with pytest.raises(ValueError, match="2 rows, the mailbox holds 1"):
        wait_rows(_host(1, dtype=torch.int32), one, _host(1, dtype=torch.int32), _host(1, 16),
                  torch.zeros(2, 16, device=DEVICE), 0)
