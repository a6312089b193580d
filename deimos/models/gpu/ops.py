"""The layer ops on the Triton kernels (deimos.kernels.triton); the oracle is
deimos.models.ops.ReferenceOps.

Every step reads the paged KV cache through block tables (deimos.models.batch.SeqLayout) and
takes nothing from the host that changes between replays, so any step is graph-safe:
- a decode-only step (every sequence one token): the split-K decode attention rotates q and
  the new keys itself (RoPE and qk-norm fused into its launch), stores each new key and value
  at its slot (found through the row's table on the device) and reads the lengths from the
  positions;
- any other step: one RoPE launch rotates q and k and stores k and v at the step's slots; the
  decode rows then run the decode attention and the prefill chunks the varlen flash kernel
  (its (sequence, tile) map made on the host once per step, or captured with the graph).
"""

from __future__ import annotations

import torch

from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.decode_attention import NewToken, decode_attention, variant_rows
from deimos.kernels.triton.gated_norm import rms_norm_gated
from deimos.kernels.triton.moe_router import RouterScratch
from deimos.kernels.triton.norm import add_rms_norm, rms_norm
from deimos.kernels.triton.output_gate import output_gate
from deimos.kernels.triton.prefill_attention import paged_prefill_attention, prefill_tile_map
from deimos.kernels.triton.rope import apply_rope, rope_inv_freq
from deimos.kernels.triton.shared_gate import shared_gate_add
from deimos.models.batch import Batch
from deimos.models.config import ModelConfig
from deimos.models.gpu.linear import GEMV_ROWS, InputCache, gated_pair
from deimos.models.gpu.moe_ops import FUSED, ResidentSlots, moe_step
from deimos.models.ops import ExpertSum, StepState
from deimos.quant.triton.gemv_q8 import empty_quantized
from deimos.switches import env_switch

# read once: DEIMOS_ATTN_MERGE=1 merges the decode attention's splits in the split launch
# (decode_attention's ``counters``) instead of a combine launch of its own. Off: measured slower
# (session 49, H100, qwen3moe 30B-A3B batch-1 tg128: 325 t/s against 399 without it; the third
# session's form, without the skip of the splits past a row's keys, was slower too)
MERGE = env_switch("DEIMOS_ATTN_MERGE", False)


class TritonOps:
    graph_safe = True  # a one-token step can be captured (deimos.runtime.graph)
    prefill_graphs = True  # and a padded prompt chunk

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None, device: str | torch.device,
                 inputs: InputCache | None = None):
        self.cfg = cfg
        # with the model's InputCache, a decode step's norm, activation and attention kernels
        # also write their output as the next GEMV's integer activation (one launch less each)
        self.inputs = inputs
        bases = sorted({cfg.layer_rope_base(i) for i in range(cfg.n_layer)})
        self.inv_freq = {b: rope_inv_freq(cfg.rope_dim, b, cfg.rope_scale, freq_factors, device)
                         for b in bases}  # fmt: skip
        self.slots = ResidentSlots()
        # the fused MoE decode's router scratch (None: the unfused chain; moe_ops.FUSED)
        self.router = RouterScratch() if FUSED != "0" else None
        self.offload = None  # deimos.models.gpu.offload.ExpertOffload, for experts kept on the host

    def begin(self, batch: Batch) -> StepState:
        # int32 positions: what the rope and decode-attention kernels read
        seqs = batch.seqs
        nd = seqs.n_decode
        prefill = None
        if nd < seqs.n_seqs:  # the prefill chunks' offsets from their first token, and tiles
            tiles = seqs.tile_map
            if tiles is None:
                cfg = self.cfg
                tiles = prefill_tile_map(seqs.q_lens[nd:], cfg.n_head, cfg.n_head_kv, cfg.head_dim,
                                         batch.tokens.device)
            prefill = (seqs.cu_q[nd:] - nd, tiles)
        return StepState(batch, batch.tokens.shape[0], batch.positions.to(torch.int32), prefill)

    def _quantized_for(self, rows: int, k: int, device: torch.device):
        if self.inputs is None or rows != 1 or k % 32:
            return None
        return empty_quantized(rows, k, device)

    def _half_for(self, rows: int, k: int, device: torch.device):
        """A batch's rows (T > 1) in float16, for the kernel making them to fill: what the
        next matmuls read (InputCache.put_half), with no cast launch between."""
        if self.inputs is None or rows < 2:
            return None
        return torch.empty((rows, k), dtype=torch.float16, device=device)

    def add_rms_norm(self, x, residual, weight, eps):
        mix, add, gate = None, None, None
        if isinstance(x, ExpertSum):  # moe(..., defer=True): the experts' sum in this launch
            x, mix, add, gate = x
        t, d = (x.shape[0], x.shape[1]) if mix is None else (mix.shape[0], x.shape[1])
        qx = self._quantized_for(t, d, x.device)
        half = self._half_for(t, d, x.device)
        y, r = add_rms_norm(x, residual, weight, eps, quantized=qx, half=half, mix=mix, add=add, gate=gate)
        if qx is not None:
            self.inputs.put(y, qx)
        if half is not None:
            self.inputs.put_half(y, half)
        return y, r

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def attention(self, q, k, v, layer, step, rope_base, scale, window, head_norms=None, gated=False):
        batch = step.batch
        seqs, kv = batch.seqs, batch.kv
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        bs = kv.block_size
        inv_freq = self.inv_freq[rope_base]
        nd = seqs.n_decode
        paged = dict(block_tables=seqs.tables, block_size=bs)
        if step.extra is None and v.shape == k.shape:
            # decode only, one launch: the attention kernel rotates (and head-norms) q and the
            # new keys itself and stores each new key and value at its slot. With one row, the
            # combine kernel also quantizes the output per head (whole groups of 32 a head),
            # unless an output gate comes first (it quantizes its own output: output_gate)
            n = step.n
            qx = None
            if n == 1 and q.shape[2] % 32 == 0 and not gated:
                qx = self._quantized_for(1, q.shape[1] * q.shape[2], q.device)
            # more rows than the integer GEMVs take: the output in float16, what the output
            # projection's matmul reads (no cast launch between them)
            half = None
            if n > GEMV_ROWS and not gated and self.inputs is not None:
                half = torch.empty(q.shape[:2] + (v.shape[2],), dtype=torch.float16, device=q.device)
            new = NewToken(k, v, inv_freq, self.cfg.rope_type, head_norms)
            out = decode_attention(q, k_cache, v_cache, step.rope, scale, window, quantized=qx,
                                   new=new, out=half, counters=self._counters(n), **paged)  # fmt: skip
            if qx is not None:
                out = out.view(1, -1)  # what the output projection reads
                self.inputs.put(out, qx)
            return out
        # one launch: q (head-normed and) rotated in place, k rotated and v stored at the
        # step's slots. In place on q: it is the step's own projection output (a view of the
        # fused q/k/v product, rotated where it lies: a copy of it cost ~0.9 ms of a 2,048-token
        # llama 8B prompt, H100; gated attention's query half, strided within its heads, is made
        # whole first; the decode launch reads it as is)
        if gated:
            q = q.contiguous()
        apply_rope(q, k, step.rope, inv_freq, self.cfg.rope_type, inplace=True,
                   cache=(v, k_cache, v_cache), head_norms=head_norms, slots=seqs.slots)
        if step.extra is None:
            return decode_attention(q, k_cache, v_cache, step.rope, scale, window,
                                    counters=self._counters(step.n), **paged)  # fmt: skip
        out = torch.empty(q.shape[:2] + (v.shape[2],), dtype=q.dtype, device=q.device)
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, step.rope[:nd], scale, window, out=out[:nd],
                             block_tables=seqs.tables[:nd], block_size=bs, counters=self._counters(nd))
        cu, tiles = step.extra
        paged_prefill_attention(q[nd:], k_cache, v_cache, seqs.tables[nd:], cu, seqs.q_start[nd:], tiles,
                                bs, scale, window, out=out[nd:])
        return out

    def _counters(self, rows: int) -> torch.Tensor | None:
        """The split-K scratch's counters for a decode attention of ``rows`` rows to merge its
        splits in its own launch (None: the combine launch; DEIMOS_ATTN_MERGE not 1, no
        scratch, or too few counters)."""
        split = self.inputs.split if self.inputs is not None and MERGE else None
        if split is None or rows * self.cfg.n_head_kv > split.counters.numel():
            return None
        return split.counters

    def eager_decode_rows(self, s: int, max_rows: int) -> list[int]:
        """Decode row counts (1..``max_rows``) of eager steps over tables of ``s`` positions,
        one for each variant of the decode attention's kernels they build: the rows a load's
        warm-up steps run so that no request compiles one (``variant_rows``)."""
        return variant_rows(s, max_rows, self.cfg.n_head_kv, self.cfg.head_dim)

    def _made_quantized(self, make, rows: int, k: int, device, whole_groups: bool = True):
        """``make(qx)``'s output, ``qx`` the QuantizedX it also fills for the next GEMV (a
        decode row's, when its groups of 32 fit the kernel: ``whole_groups``) or None."""
        qx = self._quantized_for(rows, k, device) if whole_groups else None
        y = make(qx)
        if qx is not None:
            self.inputs.put(y, qx)
        return y

    def gated_act(self, gate, up, activation):
        half = self._half_for(gate.shape[0], gate.shape[1], gate.device)
        y = self._made_quantized(lambda qx: gated_act(gate, up, activation, quantized=qx, half=half),
                                 gate.shape[0], gate.shape[1], gate.device)
        if half is not None:
            self.inputs.put_half(y, half)
        return y

    def gated_mlp(self, x, gate, up, activation):
        """One launch (``matmul_gated``) where gate and up are one fused matrix whose rows take
        the matmul path (``linear.gated_pair``, ``gated``), else the two products and
        ``gated_act``."""
        pair = gated_pair(gate, up)
        y = pair.gated(x, activation) if pair is not None else None
        return y if y is not None else self.gated_act(gate(x), up(x), activation)

    def rms_norm_gated(self, o, z, weight, eps):
        """The Gated DeltaNet block's output norm; a decode row's also as the output
        projection's integer activation (kernels.triton.gated_norm: groups within a head)."""
        t, hv, dh = o.shape
        return self._made_quantized(lambda qx: rms_norm_gated(o, z, weight, eps, quantized=qx),
                                    t, hv * dh, o.device, dh % 32 == 0)

    def output_gate(self, attn, gate):
        """Gated attention's output gate; a decode row's also as the output projection's
        integer activation (kernels.triton.output_gate: groups within a head)."""
        t, h, dh = gate.shape
        return self._made_quantized(lambda qx: output_gate(attn, gate, quantized=qx),
                                    t, h * dh, attn.device, dh % 32 == 0)

    def shared_gate_add(self, routed, shared, x, gate_inp):
        """The shared expert's gate and the MoE sum in one launch (kernels.triton.shared_gate)."""
        return shared_gate_add(routed, shared, x, gate_inp, out=routed)

    def attach_offload(self, offload) -> None:
        """Route every MoE block through ``offload`` (its experts on the host, a GPU cache of
        slots). Its decode steps are still graphs (the host answers through a mailbox after
        the launch: ``serve_replay``); its prompt chunks' staging is decided by the host at each
        layer, so no prefill graph captures them."""
        self.offload = offload
        self.prefill_graphs = False

    def serve_replay(self, n_rows: int) -> None:
        """A decode graph was launched (its first ``n_rows`` rows real): the host's part of it
        (an offloaded MoE's misses), before the step's outputs are read."""
        if self.offload is not None:
            self.offload.serve_step(n_rows)

    def numbers(self) -> dict | None:
        """The expert cache's numbers for /metrics and the dashboard (None: no offload)."""
        return self.offload.numbers() if self.offload is not None else None

    def between_steps(self, n_tokens: int | None = None) -> None:
        if self.offload is not None:
            self.offload.between_steps(n_tokens)

    def shed_memory(self) -> bool:
        """After a step ran out of device memory: an offloaded MoE's expert cache gives a
        step's room back (``ExpertOffload.shed``); False when nothing could be given."""
        return self.offload is not None and self.offload.shed()

    def moe(self, x, block, defer=False):
        """The routed experts of ``block``: all on the device (deimos.models.gpu.moe_ops), or
        through the offload's cache and the CPU. ``defer``: the unfused chain's combine is left
        to the next ``add_rms_norm`` (an ``ExpertSum``)."""
        qx = self.inputs.quantized(x) if self.inputs is not None and x.shape[0] == 1 else None
        if self.offload is not None:
            return self.offload.moe(x, block, quantized=qx)
        half = self.inputs.half(x) if self.inputs is not None and x.shape[0] > 1 else None
        return moe_step(x, block, self.slots(block.n_expert, x.device), quantized=qx, router=self.router,
                        experts_fused=FUSED == "1", half=half, defer=defer)

    def moe_shared(self, x, block, defer=False):
        """A MoEShared block: with every expert on the device and the unfused one-token chain,
        the shared expert first, then the routed experts' combine adds its gated rows
        (``moe_combine(..., gate=...)``: one launch a layer fewer than the combine and then
        ``shared_gate``), or with ``defer`` the next norm does; otherwise the routed experts,
        then ``shared_gate_add``."""
        shared = block.shared
        if self.offload is None and FUSED != "1" and x.is_contiguous():
            # x's integer activation taken before the shared expert's activation replaces it
            # in the input cache (one quantize_x launch less)
            qx = self.inputs.quantized(x) if self.inputs is not None and x.shape[0] == 1 else None
            half = self.inputs.half(x) if self.inputs is not None and x.shape[0] > 1 else None
            s = shared.product(x)
            routed = block.moe
            return moe_step(x, routed, self.slots(routed.n_expert, x.device), quantized=qx,
                            router=self.router, experts_fused=False,
                            shared=(s.float().contiguous(), shared.gate_inp), half=half, defer=defer)
        return self.shared_gate_add(block.moe(x), shared.product(x), x, shared.gate_inp)
