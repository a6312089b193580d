"""Routed experts bigger than the card: a host copy of every expert, an elastic cache of expert
slots on the GPU, and the cache's misses computed on the CPU while the GPU computes the hits.

A MoE layer's step (``ExpertOffload.moe``):
1. on the GPU, the router's logits and ``moe_route`` (weights, ids); the ids, weights and x are
   copied to pinned host buffers behind an event;
2. the hits are enqueued on the GPU: ``moe_gemv`` (one token) or ``moe_align`` + ``moe_gemm``,
   reading the layer's slots through the cache's chunk tables and ``slot_of`` (-1: not resident,
   its rows written as 0);
3. the host waits for the event only (the route and the copies, not the experts), records the
   ids with the cache's policy and computes the misses on the CPU (``runtime.cpu_experts``,
   ggml's kernels on the GGUF blocks when ggml-python is installed) while the GPU runs step 2;
4. the CPU's weighted sum goes back to the device and ``moe_combine`` adds it to the hits';
5. the missed experts are promoted into the cache on a side stream (a few a layer and step:
   the PCIe budget), published between steps.
From ``STREAM_TOKENS`` tokens a step (prompt chunks) nothing is computed on the CPU and the
host does not wait for the routing: a chunk routes to nearly every expert of a layer, so the
experts the layer's cache does not hold are staged on the device whatever the routing
(runtime.expert_stream: the cache's free slots filled first, so the first prompt fills the
cache; the rest into a ring of two staging buffers on a copy stream of their own, the next
layer's copies enqueued while this layer computes), then the hits and the staged experts
are computed by the grouped GEMM. The chunk's routing reaches the cache's policy at the next
``between_steps``. Without memory for the staging the kernels read the missed experts from the
pinned host copy instead (after a synchronisation on the routing), and without even that the
CPU computes them.

Between steps (``between_steps``) finished promotions are published and the slot count is
re-derived from the card's free memory (NVML, at most every 100 ms: ``runtime.gpu_memory``):
when another process takes memory the cache shrinks at once and gives whole chunks back to
the driver; when it leaves, the cache grows after a second. What is kept free depends on the
step: a prompt chunk keeps its activations and the staging ring's room (the cache shrinks for
them at once), a decode step only its own small activations, so between prompts the cache
takes that room back and fills it at once (``_reserve_for``, ``_fill_free``).
``--expert-cache-gib`` fixes the size instead. Memory that vanishes between the reading and
the allocation never fails a step: a growth that cannot allocate stays at the old size, a
prompt chunk whose staging buffers cannot be allocated reads its misses from host memory
(above), and a step out of memory otherwise is recomputed after the cache sheds slots
(``shed``, deimos.engine.Engine).

Decode steps are CUDA graphs all the same (``moe`` while a graph is being captured): no host
synchronisation there, the host and the device meet in pinned host memory instead
(runtime.host_mailbox, kernels.triton.host_link). A captured layer routes on the device, posts
the ids, weights and x to the host's mailbox (``post_rows``: plain stores over PCIe, then the
layer's flag), computes the hits, then waits for the host's answer (``wait_rows``, spinning
on the layer's done flag) and combines. After launching the graph the engine calls
``serve_step``: for each layer in turn the host spins until it is posted, computes the misses
on the CPU into the mailbox, answers, and claims the layer's promotion (its victim evicted,
while the device computes the next layer); after the last layer the step's promotions are
copied together (``ExpertCache.start_batch``: one copy kernel on the side stream, which
follows the current one, so the copies wait for the step). The table the
device reads (``slot_of``) is the one published before the launch, which is the host's
mirror while the step runs: promotions change it only after the last answer. A graph's kernels read
every cache address from the chunk tables, so a graph captured with any number of slots
serves every later size. Prefill chunks (``STREAM_TOKENS`` and more: staged experts) and
other eager steps are not captured (their staging is decided by the host at each call).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from deimos.kernels.triton.host_link import post_rows, wait_rows
from deimos.kernels.triton.moe_route import moe_combine
from deimos.models.gpu.moe_ops import expert_products, route
from deimos.quant.triton.gemv_q8 import quantize_x
from deimos.quant.triton.layout import PackedWeight
from deimos.quant.triton.moe_gemv import ExpertChunks
from deimos.runtime.cpu_experts import CpuExperts, LayerExperts
from deimos.runtime.expert_cache import ExpertCache, HostExperts
from deimos.runtime.expert_stream import RING, ExpertStager, Staged
from deimos.runtime.gpu_memory import FreeMemory, SlotSizer, nvml_reader, torch_reader
from deimos.runtime.host_mailbox import HostMailbox
from deimos.runtime.kv_pool import step_bytes as activation_bytes
from deimos.runtime.share_tuner import ShareTuner

log = logging.getLogger("deimos")

PARTS = ("gate", "up", "down")
PROMOTE_PER_STEP = 2  # experts a layer copies in per step (the hit-rate study's PCIe budget)
# a captured step promotes one miss in each of this many layers (in turn: every layer's cache
# fills over the steps), all started after the step's last layer with one copy kernel (a
# copy-engine call per array had cost the host 0.25-0.5 ms a promotion inside the step: 2-4 ms
# of a ~20 ms token on an H100, qwen3moe 30B-A3B at 8 GiB)
PROMOTE_LAYERS_PER_STEP = 8
# from this many tokens a step (prefill), a layer's non-resident experts are staged on the GPU for
# the step (host-to-device copies a layer ahead, then the grouped GEMM) instead of computed on
# the CPU: a prompt chunk routes to most experts of a layer, each for many tokens (GPU work)
STREAM_TOKENS = 16
# the CPU's misses dot one 8-bit activation plane (Q8_K / Q8_0), llama.cpp's arithmetic for the
# same experts: with two (cpu_experts' default, 7e-5 relative error) ggml's dot products bound
# the misses on the H100 hosts (fd2fb9c, 28 slots, 15 threads: 19.54 ms a token with two
# planes, 16.12 ms with one; ggml 10.4 -> 8.1 ms)
CPU_PLANES = 1
EXACT_HINT = ("pip install 'deimos-llm[cpu-experts]' (ggml-python) gives them ggml's kernels"
              " where their formats have them")


def slot_table(n_expert: int, experts: np.ndarray, slots: np.ndarray, device) -> torch.Tensor:
    """int32 [E] on ``device``: ``slots[j]`` for expert ``experts[j]``, -1 for the others (what
    the expert kernels read as ``slot_of``)."""
    table = torch.full((n_expert,), -1, dtype=torch.int32)
    experts, slots = np.asarray(experts, dtype=np.int64), np.asarray(slots, dtype=np.int32)
    table[torch.from_numpy(experts)] = torch.from_numpy(slots)
    return table.to(device)


def device_count(m: int, share: float) -> int:
    """Of ``m`` missed experts, how many the device reads for a share ``share`` of the misses:
    the count that ends both sides first, with each expert costing the device ``1 - share`` and
    the CPU ``share`` (at that ratio ``share * m`` experts on the device end them together), so
    floor or ceil of ``share * m``, the larger on a tie (as rounding half up: the CPU's fixed
    cost a layer, waking ggml's threads, is not in the model). Rounding ``share * m`` instead
    gave the device 2 of 7 at 0.24 (the slower side's cost 1.52 against 1.44 with 1) and 1 of 3
    (0.76 against the CPU alone's 0.72)."""
    if m <= 0 or share <= 0:
        return 0
    if share >= 1:
        return m
    lo = int(share * m)
    hi = min(m, lo + 1)
    slower = [max(n * (1 - share), (m - n) * share) for n in (lo, hi)]  # the slower side's cost
    return hi if slower[1] <= slower[0] else lo


def by_use(experts: np.ndarray) -> np.ndarray:
    """The distinct experts of ``experts`` (a step's missed pairs), the most used first (ties:
    the lower id)."""
    uniq, counts = np.unique(experts, return_counts=True)
    return uniq[np.argsort(-counts, kind="stable")]


@dataclass
class OffloadStats:
    cpu_experts: int = 0  # (token, expert) pairs computed on the CPU
    streamed_experts: int = 0  # experts copied to the GPU for one long step
    host_read_experts: int = 0  # missed experts a captured step's kernels read from host memory
    filled_experts: int = 0  # experts placed into free slots: a long step's misses, a growth's fill
    tokens: int = 0  # token-layers routed
    resizes: int = 0


class ExpertOffload:
    """The offload of a model whose MoE blocks hold host ``PackedExperts`` (module docstring).

    ``n_slots`` or ``cache_bytes`` (``--expert-cache-gib``): a fixed size, never resized; else
    from free memory, less ``reserve_bytes`` for what is allocated after (the KV pool), elastic.
    ``memory``: the free-memory reader (default NVML, else torch). ``max_rows``: the most rows
    a captured (decode) step routes: the mailbox's size."""

    def __init__(self, model, file, device: torch.device, *, n_slots: int | None = None,
                 cache_bytes: int | None = None, reserve_bytes: int = 0,
                 memory: FreeMemory | None = None, cpu: CpuExperts | None = None,
                 max_rows: int = 64):
        self.device = torch.device(device)
        self.blocks = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
        if not self.blocks:
            raise ValueError("expert offload: the model has no MoE layers")
        self.index = {b.layer: i for i, b in enumerate(self.blocks)}
        hosts = [HostExperts({p: getattr(b, p).weight for p in PARTS}, b.n_expert) for b in self.blocks]
        for b, h in zip(self.blocks, hosts):  # the blocks read the (pinned) host copy: one copy
            for p in PARTS:
                pe = getattr(b, p)
                arrays = {a: t.view(pe.weight.n, *t.shape[2:]) for a, t in h.arrays[p].items()}
                setattr(b, p, replace(pe, weight=PackedWeight(pe.weight.ggml_type, pe.weight.n,
                                                              pe.weight.k, arrays)))
        self.n_expert = self.blocks[0].n_expert
        self.cpu = cpu or CpuExperts([LayerExperts.from_gguf(file, b.layer) for b in self.blocks],
                                     planes=CPU_PLANES)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.memory = memory
        if self.memory is None and cuda:
            index = self.device.index or 0
            self.memory = FreeMemory(nvml_reader(index) or torch_reader(index))
        self.cache = ExpertCache(hosts, 0, self.device)
        if cache_bytes is not None:
            n_slots = min(self.n_expert, int(cache_bytes) // max(1, self.cache.slot_nbytes))
        self.fixed = n_slots is not None
        self.sizer = None
        # the staging ring's most (a prompt chunk's experts): kept free with the step's bytes
        self.stage_bytes = ExpertStager.peak_bytes(self.cache.layers)
        self._step_bytes = reserve_bytes
        # a short step's activations (a decode of max_rows sequences; kv_pool.step_bytes' rule)
        self._short_bytes = activation_bytes(model.config, max(max_rows, STREAM_TOKENS))
        if self.memory is not None:
            # the engine's card: what is free now and what this process holds (the weights)
            held = torch.cuda.memory_reserved(self.device) if cuda else 0
            self.sizer = SlotSizer(self.memory, self.cache.slot_nbytes, self.n_expert,
                                   chunk_slots=self.cache.slots_per_chunk,
                                   step_bytes=reserve_bytes + self.stage_bytes,
                                   card_bytes=self.memory.free() + held)
        if n_slots is None:
            n_slots = 0 if self.sizer is None else self.sizer.fit(self.memory.free(), 0)
        self.cache.resize(n_slots)
        self.stats = OffloadStats()
        pin = cuda
        self._host = {}  # (rows, cols, dtype) -> pinned host buffer
        self._pin = pin
        # made now, not while a graph is captured (an allocation there would be replayed)
        self.mailbox = (HostMailbox(len(self.blocks), max_rows, self.blocks[0].n_expert_used,
                                    model.config.n_embd, self.n_expert, self.device) if cuda else None)
        self._templates = [self._template(i) for i in range(len(self.blocks))]
        # every layer's host copy as one chunk of E slots: kernels read a miss's rows over PCIe
        self._host_chunks = [{p: ExpertChunks({a: torch.tensor([t.data_ptr()], dtype=torch.int64,
                                                               device=self.device)
                                               for a, t in sorted(h.arrays[p].items())}, self.n_expert)
                              for p in PARTS} for h in hosts]
        # a one-token step's layers answered by _answer_token (False: the rows path, which gives
        # the same answer with more host work; bench/profile_offload.py compares the two)
        self.token_path = True
        # layers that promote a miss each captured step (bench/profile_offload.py varies it),
        # and the step's (layer, expert) promotions, started together after its last layer
        self.promote_layers = PROMOTE_LAYERS_PER_STEP
        self._promos: list[tuple[int, int, int]] = []  # (layer, expert, slot) claimed this step
        self._promo_ok = False  # serve_step's: the last step's copy has run
        self.gpu_share = 0.0  # of a layer's missed experts, the share the device reads (calibrate)
        self.tuner: ShareTuner | None = None  # tunes gpu_share while decoding (made by calibrate)
        self.split = device_count  # (misses, share) -> the device's count (bench: another rule)
        self.calibrated_share: float | None = None  # calibrate's answer, where it ran
        self.calibrated_rates: tuple[float, float] | None = None  # its (device, CPU) bytes/s
        # long steps' staging (runtime.expert_stream), each ring buffer made at its most at once
        self.stager = ExpertStager(self.device, self.stage_bytes // RING)
        self._staged: dict[int, Staged] = {}  # layer -> its staging, enqueued a layer ahead
        self._records: list = []  # (layer, pinned ids, event): a long step's routing, recorded after
        log.info("expert offload: %d MoE layers, %d of %d experts a layer on the GPU (%.2f GiB), "
                 "misses on the CPU (%s)", len(self.blocks), self.cache.n_slots, self.n_expert,
                 self.cache.nbytes / 2**30, self.cpu.backend(0))
        slow = [self.blocks[i].layer for i in range(len(self.blocks)) if self.cpu.backend(i) == "exact"]
        if slow and self.cache.n_slots < self.n_expert:  # misses happen: say why they are slow
            log.warning("expert offload: %d MoE layers (the first: %d) compute their misses with "
                        "the exact fallback, about 20x slower than ggml's kernels: %s", len(slow),
                        slow[0], EXACT_HINT)

    # ---- between steps -------------------------------------------------------------------

    def set_step_bytes(self, step_bytes: int) -> None:
        """What the sizing keeps free besides its headroom for a long step (a prompt chunk),
        once the KV pool is allocated (before: the pool's share too, reserved when the cache
        was first sized); the staging ring's most (``stage_bytes``) is added, less what its
        buffers hold already. Short steps keep less free (``between_steps``)."""
        self._step_bytes = step_bytes
        if self.sizer is not None:
            self.sizer.step_bytes = step_bytes + max(0, self.stage_bytes - self.stager.nbytes)

    def _reserve_for(self, n_tokens: int | None) -> int:
        """The sizing's step bytes for a step of ``n_tokens`` (None: a long one). A long step
        (``STREAM_TOKENS`` or more: staged experts) keeps its activations and the staging ring
        free, shrinking the cache at once where they do not fit. A short one (decode) keeps
        only a decode step's activations: the ring's buffers go back to the driver, and the
        cache may take what the long steps kept (~1.7 GiB of qwen3moe 30B-A3B at 8 GiB: ~12
        slots a layer), given back at the next prompt chunk. Returns the bytes a short step
        just stopped keeping (0 when the step before was short too)."""
        if n_tokens is None or n_tokens >= STREAM_TOKENS:
            self.set_step_bytes(self._step_bytes)  # the staging buffers held now count as used
            return 0
        left = max(0, self.sizer.step_bytes - self._short_bytes)
        if self.stager.nbytes:
            left += self.stager.nbytes
            self.stager.release()
            self.memory.stale()
        self.sizer.step_bytes = self._short_bytes
        return left

    def between_steps(self, n_tokens: int | None = None) -> None:
        """Before a step (of ``n_tokens``; None: sized as a long one): the last long step's
        routing recorded, finished promotions published, the cache resized to free memory."""
        for i, ids, ev in self._records:  # the last long step's routing, for the cache's policy
            if ev is not None:
                ev.synchronize()
            self.cache.layers[i].record(ids.numpy())
        self._records.clear()
        for staged in self._staged.values():  # staged for a layer the step never ran
            self.stager.wait(staged)  # their free-slot copies and tables precede what reads them
        self._staged.clear()
        self.cache.poll()
        if self.fixed or self.sizer is None:
            return
        cur = self.cache.n_slots
        own = self._reserve_for(n_tokens)
        want = self.sizer.target(cur)
        if own and want <= cur:
            # the room a long step kept is this process's own: taken now, without the wait
            # that growing into memory another process gave back has (whole chunks, what the
            # card's free memory allows)
            spc = self.cache.slots_per_chunk
            cap = (cur + own // self.cache.slot_nbytes) // spc * spc
            grown = min(self.sizer.fit(self.memory.free(), cur), cap)
            if grown > want:
                want = grown
                self.memory.stale()
        if want == cur:
            return
        try:
            self.cache.resize(want)
        except torch.cuda.OutOfMemoryError:  # the memory went to another process after it was read
            log.warning("expert cache: no memory to grow to %d slots a layer: staying at %d", want, cur)
            self.cache.resize(cur)  # drops any chunk the failed growth added
            return
        self.stats.resizes += 1
        log.info("expert cache: %d -> %d slots a layer (%.2f GiB)", cur, want, self.cache.nbytes / 2**30)
        if want > cur:
            self._fill_free()

    def _fill_free(self) -> None:
        """A grown cache's free slots filled at once with each layer's most valuable experts
        not resident (the policy's values: the prompt's routing, recorded), as one batch of
        copies on the side stream (``ExpertCache.start_batch``), instead of one promotion a
        step in 8 layers (~70 steps for 12 new slots in 48 layers). Skipped while a batch
        still copies (its descriptors)."""
        if not self.cache.batch_ready():
            return
        claims = []
        for i, lay in enumerate(self.cache.layers):
            free = len(lay.free_slots())
            if free:
                claims += self.cache.claim(i, lay.best_missing(free))
        self.cache.start_batch(claims, self.stream)
        self.stats.filled_experts += len(claims)

    def shed(self, nbytes: int | None = None) -> bool:
        """A step ran out of device memory (another process took it between the sizing's last
        reading and the step): drop slots, whole chunks, worth ``nbytes`` (default: the step's
        own bytes, ``set_step_bytes``; one chunk at least), given back to the driver. The
        sizing regrows them once the memory has stayed free (``between_steps``; a fixed
        cache stays smaller). False when the cache holds no slot to give."""
        cur = self.cache.n_slots
        if cur == 0:
            return False
        chunk = self.cache.slots_per_chunk
        want = self._step_bytes if nbytes is None else int(nbytes)
        drop = max(1, -(-want // max(1, self.cache.slot_nbytes)))
        n = max(0, cur - -(-drop // chunk) * chunk)
        self.cache.resize(n)
        if self.memory is not None:
            self.memory.stale()
        self.stats.resizes += 1
        log.warning("expert cache: a step ran out of device memory: %d -> %d slots a layer "
                    "(%.2f GiB)%s", cur, n, self.cache.nbytes / 2**30,
                    " (a fixed size: it stays there)" if self.fixed else "")
        return True

    # ---- a layer's step ------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor, key: str) -> torch.Tensor:
        buf = self._host.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        buf.copy_(t, non_blocking=self._pin)
        return buf

    def _chunks(self, lay, part: str) -> ExpertChunks:
        arrays = sorted(lay.host.arrays[part])
        return ExpertChunks({a: lay.chunk_ptrs[(part, a)] for a in arrays}, lay.spc)

    def _hits(self, x, block, lay, ids, quantized=None) -> torch.Tensor:
        """The resident experts' share on the GPU ([T * k, D] float32, misses' rows 0).
        ``quantized``: x's integer activation (one token), when made already."""
        stacks = {p: lay.slot_weight(0, p) for p in PARTS}  # formats, K, arrays (chunk tables address)
        chunks = {p: self._chunks(lay, p) for p in PARTS}
        return expert_products(x, block, ids, lay.slot_of, stacks, chunks, quantized=quantized)

    def _moe_long(self, xf, block, i: int, weights, ids) -> torch.Tensor | None:
        """A long step's layer ``i`` (module docstring): the layer's non-resident experts
        staged on the copy stream (prefetched while the layer before ran, else now), the next
        layer's staging enqueued, then the hits and the staged experts on the device; no host
        synchronisation. None when the staging has no memory (the caller's fallback)."""
        lay = self.cache.layers[i]
        staged = self._staged.pop(i, None)
        try:
            if staged is None:
                staged = self.stager.stage(lay)
        except torch.cuda.OutOfMemoryError:
            self.stager.release()
            return None
        j = i + 1
        if j < len(self.blocks) and j not in self._staged:
            try:
                self._staged[j] = self.stager.stage(self.cache.layers[j])
            except torch.cuda.OutOfMemoryError:  # that layer stages at its turn (or falls back)
                pass
        self.stager.wait(staged)
        t = xf.shape[0]
        if lay.n_slots and (lay.slot_of_host >= 0).any():
            y = self._hits(xf, block, lay, ids)
        else:
            y = torch.zeros((t * block.n_expert_used, xf.shape[1]), dtype=torch.float32, device=xf.device)
        if staged.experts.size:
            y = y + expert_products(xf, block, ids, staged.table, staged.stacks)
        self.stager.done(staged)
        self.stats.tokens += t
        self.stats.streamed_experts += int(staged.experts.size)
        self.stats.filled_experts += int(staged.placed.size)
        self._records.append((i, self._to_host(ids, f"record{i}"), self._event()))
        return moe_combine(y, weights)

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _host_read(self, x, block, i: int, ids, experts: np.ndarray) -> torch.Tensor:
        """``experts``' share of the step, the kernels reading their rows from the pinned host
        copy (layer i's one-chunk table). [T * k, D] float32, rows of the other experts 0."""
        return expert_products(x, block, ids, slot_table(self.n_expert, experts, experts, x.device),
                               self._templates[i], self._host_chunks[i])

    def _template(self, i: int) -> dict[str, PackedWeight]:
        """Layer i's parts as one-row device weights: what the expert kernels take from a stack
        whose slots live in chunks (formats, K, the arrays' dtypes and row widths), whether or
        not a chunk exists when a graph is captured."""
        host = self.cache.layers[i].host
        return {p: PackedWeight(host.parts[p][0], 1, host.parts[p][1],
                                {a: torch.zeros((1, *t.shape[2:]), dtype=t.dtype, device=self.device)
                                 for a, t in host.arrays[p].items()})
                for p in PARTS}

    def _moe_captured(self, x: torch.Tensor, block, quantized=None) -> torch.Tensor:
        """``moe`` inside a graph being captured (module docstring): route, post, hits, wait
        for the host's misses, combine; nothing here waits on the host."""
        box = self.mailbox
        i = self.index[block.layer]
        lay = self.cache.layers[i]
        t = x.shape[0]
        if t > box.rows:
            raise ValueError(f"expert offload: a captured step of {t} rows, the mailbox holds {box.rows}")
        xf = x.float().contiguous()
        weights, ids = route(xf, block)
        post_rows(ids, weights, xf, box.ids[i], box.weights[i], box.x[i], box.flag(i, box.POSTED),
                  box.seq, box.count, bump=i == 0)
        chunks = {p: self._chunks(lay, p) for p in PARTS}
        # one token: x's integer activation once, for both passes (the norm's, when it made it)
        qx = quantized if quantized is not None or t != 1 else quantize_x(xf)
        y = expert_products(xf, block, ids, lay.slot_of, self._templates[i], chunks, quantized=qx)
        # the host's split: the misses the device reads from host memory (its table, as rows)
        table = wait_rows(box.flag(i, box.DECIDED), box.seq, box.error, box.table_rows(i),
                          torch.empty((1, self.n_expert), dtype=torch.float32, device=x.device), i)
        y = y + expert_products(xf, block, ids, table.view(torch.int32)[0], self._templates[i],
                                self._host_chunks[i], quantized=qx)
        add = wait_rows(box.flag(i, box.DONE), box.seq, box.error, box.out[i],
                        torch.empty((t, x.shape[1]), dtype=torch.float32, device=x.device), i)
        return moe_combine(y, weights, add=add)

    def serve_step(self, n_rows: int) -> None:
        """The host's side of a captured step just launched, whose first ``n_rows`` rows are
        real (the rest padding): every layer's misses, in order (module docstring)."""
        box = self.mailbox
        if box is None:
            raise RuntimeError("expert offload: serve_step before any step was captured")
        step = box.begin_step()
        t0 = time.perf_counter()
        misses = 0
        n_layer = len(self.blocks)
        per = self.promote_layers
        first = step * per % n_layer  # the layers that promote this step
        self._promos.clear()
        self._promo_ok = self.cache.batch_ready()  # whether this step may claim (the last copy ran)
        try:
            with torch.inference_mode():  # the cache's tables were made in it (the engine's steps)
                for i in range(n_layer):
                    box.wait_posted(i)
                    misses += self._answer(i, n_rows, (i - first) % n_layer < per)
                # the step's promotions, claimed layer by layer after each answer (while the
                # device computes the next layer), copied together after the last one
                self.cache.start_batch(self._promos, self.stream)
        finally:
            box.release_all()  # after a failure: the device's step still ends
        if self.tuner is not None:
            self.gpu_share = self.tuner.observe(time.perf_counter() - t0, misses)

    def _answer(self, i: int, n: int, promote: bool) -> int:
        """Layer i's misses of the step: the device's share decided, the CPU's computed, the
        layer answered, a promotion started. Returns the layer's missed pairs."""
        if n == 1 and self.token_path:
            return self._answer_token(i, promote)
        box, lay = self.mailbox, self.cache.layers[i]
        ids = box.np_ids[i, :n]
        lay.record(ids)
        rows, slots = np.nonzero(lay.slot_of_host[ids] < 0)  # the table the device reads
        self.stats.tokens += n
        out = box.np_out[i, :n]
        out.fill(0)
        experts = None
        table = box.np_table[i]
        table.fill(-1)
        ranked = None
        missed = int(rows.size)
        if rows.size:
            experts = ids[rows, slots]
            ranked = by_use(experts)  # the missed experts, the most used first
            gpu = ranked[: self.split(ranked.size, self.gpu_share)]
            if gpu.size:  # the device's share (module docstring)
                table[gpu] = gpu
                cpu = table[experts] < 0
                rows, slots, experts = rows[cpu], slots[cpu], experts[cpu]
                self.stats.host_read_experts += int(gpu.size)
        box.decide(i)
        if rows.size:
            self.cpu(i, torch.from_numpy(box.np_x[i, :n]), rows, experts,
                     box.np_weights[i, :n][rows, slots], out=torch.from_numpy(out))
            self.stats.cpu_experts += int(rows.size)
        box.answer(i)
        if promote and ranked is not None and lay.n_slots:  # copied after the step's last layer
            self._claim_promotion(i, int(ranked[0]))
        return missed

    def _claim_promotion(self, i: int, expert: int) -> None:
        """Layer i's promotion of ``expert`` claimed now (its victim evicted), copied with the
        step's others after its last layer (``serve_step``); none while the last step's copy
        still runs."""
        if self._promo_ok:
            self._promos.extend(self.cache.claim(i, [expert]))

    def _answer_token(self, i: int, promote: bool) -> int:
        """``_answer`` for a one-token step (batch-1 decode), with as little host work as the
        layer's critical path allows: the same split and sums (a token's experts are distinct,
        so by_use's order is the ids' order), the cache's statistics after the answer."""
        box, lay = self.mailbox, self.cache.layers[i]
        ids = box.np_ids[i, 0]
        miss = np.flatnonzero(lay.slot_of_host[ids] < 0)  # slot positions of the missed experts
        table = box.np_table[i]
        table.fill(-1)
        out = box.np_out[i, 0]
        out.fill(0)
        n_dev = 0
        if miss.size:
            miss = miss[np.argsort(ids[miss], kind="stable")]  # by expert id: by_use's order
            n_dev = self.split(int(miss.size), self.gpu_share)
            if n_dev:  # the device's share (module docstring)
                dev = ids[miss[:n_dev]]
                table[dev] = dev
        box.decide(i)
        cpu = np.sort(miss[n_dev:])  # in slot order: the rows path's order of the sum
        if cpu.size:
            self.cpu.token(i, box.np_x[i, 0], ids[cpu], box.np_weights[i, 0][cpu], out)
        box.answer(i)
        lay.record(ids)  # the policy's statistics: off the device's path
        self.stats.tokens += 1
        self.stats.host_read_experts += n_dev
        self.stats.cpu_experts += int(cpu.size)
        if promote and miss.size and lay.n_slots:  # copied after the step's last layer
            self._claim_promotion(i, int(ids[miss[0]]))
        return int(miss.size)

    def fix_share(self, share: float) -> None:
        """Pin the device's share of a step's misses at ``share`` (0: every miss on the CPU, 1:
        every miss read by the device): the tuner dropped, so decoding keeps it."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"expert offload: the device's share {share} is outside [0, 1]")
        self.gpu_share, self.tuner = float(share), None

    def calibrate(self, reps: int = 5) -> float:
        """Measure the rate of each side on a token's experts (8 for qwen3moe): the CPU's (ggml)
        and the device's reading them from host memory (the second pass of a captured step),
        and set ``gpu_share`` so that both finish together: g / (g + c) of a step's missed
        experts go to the device. Returns it. Each of ``reps`` timings is on a layer of its own
        with experts no earlier call touched (misses come from memory, not from the CPU's
        caches), after a call on other experts of that layer (the kernels compiled, ggml's
        plan made). Measured at load, on this machine's bus and cores: a desktop's PCIe and
        CPU give another split than a server's. Each side measured alone: the decode steps
        then tune it (``tuner``, runtime.share_tuner), both sides reading host memory at once."""
        if self.device.type != "cuda" or not self.blocks:
            return 0.0
        k = min(self.blocks[0].n_expert_used, self.n_expert)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, self.mailbox.d, generator=g)
        xd = x.to(self.device)
        w = np.full(k, 1.0 / k, dtype=np.float32)
        t_dev, t_cpu, nbytes = [], [], 0
        for r in range(reps):
            li = r % len(self.blocks)
            block = self.blocks[li]
            perm = torch.randperm(self.n_expert, generator=g).numpy().astype(np.int64)
            warm, dev_e, cpu_e = perm[:k], perm[k:2 * k], perm[2 * k:3 * k]
            if cpu_e.size < k:  # too few experts for three distinct sets: reuse (cached: optimistic)
                dev_e, cpu_e = warm, warm
            for e in (warm, dev_e):
                ids = torch.from_numpy(e.astype(np.int32)).view(1, -1).to(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self._host_read(xd, block, li, ids, e)
                end.record()
                end.synchronize()
            t_dev.append(start.elapsed_time(end) / 1e3)
            out = np.zeros(x.shape[1], dtype=np.float32)
            self.cpu.token(li, x[0].numpy(), warm, w[: warm.size], out)  # the decode path
            t0 = time.perf_counter()
            self.cpu.token(li, x[0].numpy(), cpu_e, w[: cpu_e.size], out)
            t_cpu.append(time.perf_counter() - t0)
            nbytes = k * self.cache.layers[li].host.expert_nbytes
        td, tc = sorted(t_dev)[reps // 2], sorted(t_cpu)[reps // 2]
        self.gpu_share = self.calibrated_share = tc / (td + tc)  # rates k / td and k / tc: g / (g + c)
        self.calibrated_rates = (nbytes / td, nbytes / tc)
        self.tuner = ShareTuner(self.gpu_share)  # the start: decoding tunes it (runtime.share_tuner)
        log.info("expert offload: the device reads misses from host memory at %.1f GB/s, the CPU "
                 "computes them at %.1f GB/s: %.0f%% of a step's missed experts go to the device",
                 *(r / 1e9 for r in self.calibrated_rates), 100 * self.gpu_share)
        return self.gpu_share

    def _promote(self, lay, experts: np.ndarray) -> None:
        """The layer's PROMOTE_PER_STEP most used misses of a step into the cache."""
        lay.promote_many(by_use(experts)[:PROMOTE_PER_STEP].tolist(), self.stream)

    def moe(self, x: torch.Tensor, block, quantized=None) -> torch.Tensor:
        """x float32 ``[T, D]`` -> float32 ``[T, D]``: ``block``'s routed experts. ``quantized``:
        x's integer activation (one token) when the norm kernel made it."""
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self._moe_captured(x, block, quantized)
        i = self.index[block.layer]
        lay = self.cache.layers[i]
        t, k = x.shape[0], block.n_expert_used
        xf = x.float().contiguous()
        weights, ids = route(xf, block)
        if t >= STREAM_TOKENS:
            y = self._moe_long(xf, block, i, weights, ids)
            if y is not None:
                return y
        ids_h = self._to_host(ids, "ids")
        w_h = self._to_host(weights, "weights")
        x_h = self._to_host(xf, "x")
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        # the table the GPU reads is the published one: what slot_of_host says now
        resident = lay.slot_of_host.copy()
        if lay.n_slots and (resident >= 0).any():
            y = self._hits(xf, block, lay, ids, quantized=quantized)
        else:
            y = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
        if ready is not None:
            ready.synchronize()  # the route and the copies; the experts still run
        ids_np = ids_h.numpy().astype(np.int64)
        lay.record(ids_np)
        miss = resident[ids_np] < 0  # [T, k]
        rows, slots = np.nonzero(miss)
        self.stats.tokens += t
        add = None
        streamed = False
        if rows.size and t >= STREAM_TOKENS:  # no memory to stage: the kernels read the host copy
            missed = np.unique(ids_np[rows, slots])
            try:
                y = y + self._host_read(xf, block, i, ids, missed)
                self.stats.host_read_experts += int(missed.size)
                streamed = True
                log.warning("expert offload: no GPU memory to stage %d experts: the kernels "
                            "read them from host memory", missed.size)
            except torch.cuda.OutOfMemoryError:  # not even the products' rows: the CPU
                log.warning("expert offload: no GPU memory for %d experts: computed on the "
                            "CPU", missed.size)
        if rows.size and not streamed:
            experts = ids_np[rows, slots]
            part = self.cpu(i, x_h, rows, experts, w_h.numpy()[rows, slots])
            self.stats.cpu_experts += int(rows.size)
            add = part.to(x.device, non_blocking=self._pin) if x.device.type != "cpu" else part
            if lay.n_slots:
                self._promote(lay, experts)
        return moe_combine(y, weights, add=add)

    def numbers(self) -> dict[str, float]:
        """For /metrics and the dashboard: slots, hit rate, CPU-computed experts per token."""
        s = self.cache.stats()
        per_token = self.stats.cpu_experts / self.stats.tokens if self.stats.tokens else 0.0
        return {"expert_slots": s["slots"], "expert_cache_bytes": s["bytes"],
                "expert_hit_rate": s["hit_rate"], "cpu_experts_per_token": per_token,
                "expert_promotions": s["promotions"], "expert_resizes": self.stats.resizes,
                "streamed_experts": self.stats.streamed_experts,
                "host_read_experts": self.stats.host_read_experts, "gpu_share": self.gpu_share}
