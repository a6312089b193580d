"""MTP ("multi-token prediction", llama.cpp's "nextn") heads of qwen35, qwen35moe and qwen3next:
one extra decoder block after the main layers that predicts the token after next from the main
model's last hidden state and the token just sampled, the draft head of speculative decoding.

Storage (llama.cpp 11434: src/llama-model.cpp load_hparams, src/models/qwen35.cpp,
qwen35moe.cpp, qwen3next.cpp load_arch_tensors; its converter conversion/qwen.py _QwenMtpMixin):
- ``<arch>.block_count`` (n_layer_all) counts the main layers AND the MTP layers;
  ``<arch>.nextn_predict_layers`` (n_layer_nextn) says how many of them, at the end, are MTP
  layers; the main model has n_layer = n_layer_all - n_layer_nextn layers and its graph loops
  over those only (the main context's KV cache is filtered to il < n_layer; the MTP tensors are
  TENSOR_SKIP unless the model is loaded with load_mtp). An ``attention.recurrent_layers`` array
  has n_layer_all entries, 0 for the MTP layers; with ``full_attention_interval`` llama.cpp
  sets is_recr(il) only for il < n_layer: an MTP layer is always full attention.
- MTP layer L = n_layer + j (the converter maps HF ``mtp.layers.j.*`` to ``blk.{n_layer+j}.*``,
  ``mtp.fc`` to ``nextn.eh_proj``, ``mtp.pre_fc_norm_embedding`` to ``nextn.enorm``,
  ``mtp.pre_fc_norm_hidden`` to ``nextn.hnorm``, ``mtp.norm`` to ``nextn.shared_head_norm``;
  like every other norm weight they get +1 there, so the GGUF gains multiply directly):
    blk.L.attn_norm, blk.L.post_attention_norm                  [D]
    blk.L.attn_q [D -> 2 H Dh] (q and its gate per head), attn_k, attn_v, attn_output,
    attn_q_norm, attn_k_norm                                     (a gated full-attention layer)
    blk.L.ffn_gate/up/down (qwen35) or the routed + shared experts (qwen35moe, qwen3next)
    blk.L.nextn.eh_proj   [2 D -> D]   (ggml ne {2 D, D})
    blk.L.nextn.enorm, blk.L.nextn.hnorm                         [D]
    optional: blk.L.nextn.embed_tokens [V, D] (else token_embd), nextn.shared_head_head
    [V, D] (else output, i.e. token_embd when tied), nextn.shared_head_norm [D] (else
    output_norm). The Qwen files carry shared_head_norm and share the embedding and the head.

One MTP step (llama_model_qwen35::graph_mtp; qwen35moe's and qwen3next's graph_mtp alike, only
the feed-forward block and the RoPE call differ as in their main layers; vLLM's
qwen3_next_mtp.py Qwen3NextMultiTokenPredictor.forward computes the same), for a row with
token x (the token at position p) and hidden state h (D):
    e   = E[x]                                  E: nextn.embed_tokens, else token_embd
    u   = eh_proj @ concat(rms_norm(e) * enorm, rms_norm(h) * hnorm)       (e first, then h)
    a   = u + attn_output(gated_attention(rms_norm(u) * attn_norm))       at position p, over the
                                                  MTP layer's OWN KV cache (positions 0 .. p)
    o   = a + ffn(rms_norm(a) * post_attention_norm)
    h'  = rms_norm(o) * (nextn.shared_head_norm, else output_norm)
    logits = head @ h'                           head: nextn.shared_head_head, else output
``h`` is the main model's hidden state AFTER its final norm (llama.cpp's t_h_nextn is set
after build_norm(output_norm) in the qwen35/qwen35moe/qwen3next main graphs, despite the
"before final output norm" comment in llama-graph.h; vLLM feeds Qwen3NextModel.forward's
output, which ends in self.norm): ``Qwen35Model.step(batch, hidden_at=...)`` returns exactly
those rows. ``h'`` is what a further draft step takes as its h (llama.cpp reads the MTP
context's own t_h_nextn; vLLM its own post-norm output).

Which h goes with which token (llama.cpp common/speculative.cpp, draft-mtp): the MTP layer's
cache position p holds the row (x_p, h_{p-1}): the main model's hidden at p - 1 (the one that
predicted x_p) with the token x_p, predicting x_{p+1}; position 0 pairs x_0 with h = 0 (its
pending row starts as zeros). After the main model ran positions s .. e-1 the MTP catches up on
the same tokens with hiddens [h_{s-1}, h_s .. h_{e-2}], then drafts: row (x_e, h_{e-1}) at e
gives d_1; row (d_1, h'_e) at e+1 gives d_2; and so on. (vLLM's EagleProposer.propose,
vllm/v1/spec_decode/eagle.py, used for MTP too, pairs (h_p, x_{p+1}) at RoPE position p instead,
the token ids shifted left and the positions kept, and has no row for x_0: the same relative
positions, one key fewer.) After a verification step the caller truncates the state to the
first drafted position and catches up on the accepted tokens with the main model's hiddens.

State: the MTP layer's attention keys and values are per sequence, like the main model's
(``MTPState``, owned by the caller, one per sequence and MTP layer; rolled back with
``truncate`` when drafted tokens are rejected). The model holds none; nothing here runs in the
main step. On the kernel path the model builds the MTP layers only when asked (``load_mtp``:
llama.cpp's main context likewise loads them only with load_mtp); they run eagerly on the
main layers' ops, their state in float16 like the KV pool.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deimos.models.batch import Batch, SeqLayout
from deimos.models.blocks import RMSNorm
from deimos.models.config import ModelConfig
from deimos.models.weights import WeightSource

BLOCK_SIZE = 64  # the state's cache blocks (its own pool, as runtime.kv_cache's)


class MTPOut(NamedTuple):
    logits: torch.Tensor  # float32 [N, V] (draft: [V]): the token after the row's token
    hidden: torch.Tensor  # float32 [N, D] (draft: [D]): h', the next draft step's h


class MTPState:
    """One sequence's cache of one MTP layer (``head``): keys ``k[0]`` and values ``v[0]``
    [n_slots, Hkv, Dh] of positions 0 .. length - 1, laid out as a one-sequence paged pool
    (block 0 scratch, position p at slot p + block_size) so that the model's attention ops read
    it as they read the main cache. Rows are written in position order; ``truncate`` forgets a
    suffix (rejected drafts)."""

    def __init__(self, cfg: ModelConfig, capacity: int, head: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None):
        if not 0 <= head < cfg.n_mtp_layers:
            raise ValueError(f"MTPState: head {head} outside the model's {cfg.n_mtp_layers} MTP layers")
        if capacity <= 0:
            raise ValueError(f"MTPState: capacity must be positive, got {capacity}")
        if dtype is None:  # as the KV pool's: float32 on the CPU reference, else float16
            dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
        n_blocks = -(-capacity // BLOCK_SIZE)
        rows = (n_blocks + 1) * BLOCK_SIZE
        self.k = [torch.zeros(rows, cfg.n_head_kv, cfg.head_dim, dtype=dtype, device=device)]
        self.v = [torch.zeros(rows, cfg.n_head_kv, cfg.head_dim_v, dtype=dtype, device=device)]
        self.block_size = BLOCK_SIZE
        self.capacity, self.head, self.length = capacity, head, 0
        self._table = torch.arange(1, n_blocks + 1, dtype=torch.int32, device=device).view(1, -1)

    def batch(self, tokens: torch.Tensor, logits_at: torch.Tensor | None = None) -> Batch:
        """The rows of ``tokens`` [T] at positions length .. length + T - 1 (``commit`` after)."""
        n, start = tokens.shape[0], self.length
        if start + n > self.capacity:
            raise ValueError(f"MTPState: {start + n} positions > capacity {self.capacity}")
        device = tokens.device
        positions = torch.arange(start, start + n, device=device)
        i32 = {"dtype": torch.int32, "device": device}
        layout = SeqLayout([n], [start], 1 if n == 1 else 0, positions + BLOCK_SIZE, self._table,
                           torch.tensor([start], **i32), torch.tensor([0, n], **i32))
        return Batch(tokens, positions, self, layout, logits_at)

    def commit(self, n: int) -> None:
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget positions ``length`` .. (drafts the main model rejected)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"MTPState.truncate: {length} outside [0, {self.length}]")
        self.length = length

    def clone(self) -> MTPState:
        out = object.__new__(MTPState)
        out.k, out.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
        out.block_size, out.capacity, out.head, out.length = self.block_size, self.capacity, self.head, self.length
        out._table = self._table
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class MTPBlock:
    """MTP layer ``layer`` (blk.N, N >= n_layer): the nextn input projection, the decoder
    layer (``layer_class``: the model's own layer type, full attention here) and the head's
    norm and projection (its own where the file has them, else the model's)."""

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource, layer_class, model):
        p, d = f"blk.{layer}.nextn", cfg.n_embd
        self.layer = layer
        self.enorm = RMSNorm(w.vector(f"{p}.enorm.weight", d), cfg.rms_eps, w.ops)
        self.hnorm = RMSNorm(w.vector(f"{p}.hnorm.weight", d), cfg.rms_eps, w.ops)
        self.eh_proj = w.linear(f"{p}.eh_proj", d, 2 * d, bias=None)
        self.block = layer_class(cfg, layer, w)
        if self.block.recurrent:
            raise ValueError(f"MTP layer {layer} built as a recurrent layer")  # config.is_recurrent
        self.block.mixer.layer = 0  # its keys and values: k[0] / v[0] of the step's MTP cache
        self.embed = (w.embedding(f"{p}.embed_tokens", cfg.n_vocab, d)
                      if w.has(f"{p}.embed_tokens.weight") else model.embed)
        self.head = (w.linear(f"{p}.shared_head_head", cfg.n_vocab, d, bias=None)
                     if w.has(f"{p}.shared_head_head.weight") else model.lm_head)
        self.norm = (RMSNorm(w.vector(f"{p}.shared_head_norm.weight", d), cfg.rms_eps, w.ops)
                     if w.has(f"{p}.shared_head_norm.weight") else model.norm)


class MTPHead:
    """The MTP layers of a model (``model.mtp``; None when the file has none): ``blocks[j]`` is
    layer n_layer + j. ``forward``/``draft`` run one sequence on its ``MTPState``; ``step`` is
    the batched form (a ``Batch`` whose ``kv`` holds the block's cache as k[0]/v[0])."""

    def __init__(self, cfg: ModelConfig, w: WeightSource, model, layer_class):
        self.config = cfg
        self.ops = w.ops
        self.blocks = [MTPBlock(cfg, i, w, layer_class, model) for i in cfg.mtp_layers]
        self.device = model.device

    def new_state(self, capacity: int, head: int = 0) -> MTPState:
        """A fresh cache for one sequence of up to ``capacity`` positions, on the model's device."""
        return MTPState(self.config, capacity, head, self.device)

    def step(self, batch: Batch, hidden: torch.Tensor, head: int = 0) -> MTPOut:
        """The rows of ``batch`` (tokens x [T] at their positions; the cache in ``batch.kv``)
        with ``hidden`` [T, D] (each row's h: see the module docstring) -> logits and h' of the
        rows ``batch.logits_at`` (default: the last)."""
        cfg, n = self.config, batch.tokens.shape[0]
        if not 0 <= head < len(self.blocks):
            raise ValueError(f"MTP head {head} outside the model's {len(self.blocks)} MTP layers")
        if tuple(hidden.shape) != (n, cfg.n_embd):
            raise ValueError(f"MTP step: hidden {tuple(hidden.shape)}, expected ({n}, {cfg.n_embd}) "
                             "(one main-model hidden state per token)")
        b = self.blocks[head]
        step = self.ops.begin(batch)
        e = b.enorm(b.embed(batch.tokens), fused=False)
        h = b.hnorm(hidden.to(e.dtype), fused=False)
        x = b.eh_proj(torch.cat((e, h), dim=-1))
        x, residual = b.block(x, None, step)
        at = batch.logits_at
        if at is None:
            at = torch.tensor([n - 1], device=x.device)
        out, _ = b.norm(x[at], residual[at])
        return MTPOut(b.head(out).float(), out.float())

    def forward(self, state: MTPState, tokens: torch.Tensor, hidden: torch.Tensor,
                logits_at: torch.Tensor | None = None) -> MTPOut:
        """Rows (tokens[t], hidden[t]) at positions state.length + t into ``state``'s cache (the
        catch-up after a main step: tokens x_s .. x_{e-1}, hiddens h_{s-1} .. h_{e-2}); logits
        and h' of ``logits_at`` (default: the last row)."""
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise ValueError(f"MTP forward: tokens must be a non-empty 1-D tensor, got {tuple(tokens.shape)}")
        out = self.step(state.batch(tokens, logits_at), hidden, state.head)
        state.commit(tokens.shape[0])
        return out

    def draft(self, hidden_last: torch.Tensor, next_token: int, state: MTPState) -> MTPOut:
        """One draft step: ``next_token`` (the token just sampled, at position state.length)
        with ``hidden_last`` [D] (the main model's post-norm hidden of the position before, or
        the previous draft's h') -> logits [V] of the token after it and its h' [D]."""
        d = self.config.n_embd
        if hidden_last.numel() != d:
            raise ValueError(f"MTP draft: hidden_last has {hidden_last.numel()} values, expected {d}")
        tokens = torch.tensor([int(next_token)], device=self.device)
        out = self.forward(state, tokens, hidden_last.reshape(1, d))
        return MTPOut(out.logits[0], out.hidden[0])
