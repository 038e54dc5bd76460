"""Paged attention in torch (CPU and CUDA): K/V live in fixed-size blocks, read via block tables.

Cache layout, per layer (one tensor for K, one for V), head-major inside a block:

    key_cache[block_id, kv_head, offset, :]      block_id < num_blocks, offset < block_size

    position p of a request  ->  block_ids[p // block_size], offset p % block_size
    (its slot number, as the engine counts, is block * block_size + offset)

Head-major blocks let a gather of rows (block_id * num_kv_heads + kv_head) of the cache viewed
as [num_blocks * num_kv_heads, block_size * head_dim] produce a request's keys already laid
out as [kv_heads, positions, head_dim], the shape attention multiplies, with no transpose copy.

A step's tokens are laid out flat, decode tokens first (engine/model/attention_metadata.py).
Decode tokens (one new token per request) are attended together, by one of three backends
(`PagedAttention.decode_backend`, chosen per step):
  "cpu_kernel"  on CPU in float32 / bfloat16: engine/model/kernels/paged_decode.c reads the
                blocks in place through the block table (ITERSCOPE_CPU_KERNELS=0 turns it off);
  "triton"      on CUDA when engine/model/kernels/triton_paged.py is available there;
  "torch"       otherwise, and the reference: the blocks are gathered into one
                [B, kv_heads, max_blocks * block_size, head_dim] buffer and masked past each
                request's length.
Prefill chunks (q_len > 1): on CPU in float32 / bfloat16,
engine/model/kernels/prefill_attention.c attends every chunk of the step in one call, reading
each one's keys (its own, just written, and any cached context) through its block table,
with no padding (ITERSCOPE_CPU_KERNELS=0 turns it off). Otherwise, and as the reference,
chunks that start at the same position, of equal or close lengths (runner.PAD_WASTE), share
one torch call, padded to the longest: fresh prompts (from position 0), and chunks over a
cached context of the same length (prompts over one cached chat template), whose keys are
that context gathered from the cache followed by their own new K/V. On CPU, batched matmuls
with a causal bias up to PLAIN_PREFILL_MAX_LEN positions of context, SDPA above; on CUDA,
SDPA always (one fused kernel, where the matmul path launches a few per 64 queries). New K/V
are written to the cache first (by attention, or before it by the decoder's RoPE kernel), and
a padded query never needs a padded key: pads come after every real position of their chunk.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model.attention_metadata import (
    AttentionMetadata,
    PrefillSpan,
    check_decode_tables,
    check_prefill_tables,
    gather_rows,
)
from engine.model.kernels import cpu_paged_decode, cpu_prefill_attention
from engine.model.linear import cpu_has_bf16_matmul

# Fresh prompts up to this length attend through plain batched matmuls and a causal bias
# (about a third faster than SDPA's flash kernel on CPU at 256); longer ones use SDPA, whose
# memory does not grow with length squared.
PLAIN_PREFILL_MAX_LEN = 512
# Query positions per matmul in that path: a chunk skips the keys after its last position
# (8 x 256 tokens, bf16: 4.7-6.0 ms per layer against 6.7-9.3 in one piece, 2 threads).
QUERY_CHUNK = 64
# SDPA's backends for prompts on CUDA: flash, and the math path for chunks over a cached context
# (which need a mask). cuDNN's builds a plan for each new shape, up to ~100 ms the first time,
# and serving keeps making new ones; with mem-efficient too a first pass still had a 160 ms
# step (bench/gpu_check.py --steps mixed, H200: 15.1-15.4k output tok/s and no step over 40 ms
# with these two, first pass and second).
CUDA_PROMPT_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class PagedAttention:
    """Writes a step's new K/V into the cache and attends through the block tables."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        device = torch.device(device)
        self.cpu_kernel = None
        if device.type == "cpu" and cpu_paged_decode.supports(
            dtype, num_heads, num_kv_heads, head_dim
        ):
            self.cpu_kernel = cpu_paged_decode.KERNEL.load()
        self.prefill_kernel = None
        if device.type == "cpu" and cpu_prefill_attention.supports(
            dtype, num_heads, num_kv_heads, head_dim
        ):
            self.prefill_kernel = cpu_prefill_attention.KERNEL.load()
        self.prefill_scratch = torch.empty(0)  # the prefill kernel's, grown as a step needs
        self.prefill_threads = 1  # of this step's prefill kernel calls
        self.triton = _triton_kernels(device)
        # Prompts up to this many positions of context attend through the batched-matmul
        # path. On CUDA none do: on an H200, SDPA took a step prefilling one 256-token prompt
        # from 18.8 to 10.1 ms and one of 2048 tokens from 71.6 to 11.4 (bench/gpu_check.py
        # --steps prefill).
        self.plain_prefill_max_len = PLAIN_PREFILL_MAX_LEN if device.type == "cpu" else 0
        self.sdpa_backends = CUDA_PROMPT_SDPA_BACKENDS if device.type == "cuda" else None
        # On CPUs without bf16 matmuls (AVX2), the plain prefill computes in float32: see
        # engine/model/linear.py. Scores and probabilities then also stay in float32.
        self.widen_plain_prefill = (
            device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16_matmul()
        )
        self.decode_backend = "torch"  # of the last step with decodes
        self.decode_rows: torch.Tensor | None = None
        self.decode_key_buffer: torch.Tensor | None = None
        self.decode_value_buffer: torch.Tensor | None = None
        self.decode_bias: torch.Tensor | None = None
        self.causal_biases: dict[tuple[int, int], torch.Tensor] = {}  # by chunk, for one step
        self.sdpa_masks: dict[tuple[int, int], torch.Tensor] = {}  # by offset and length

    def begin_step(self, meta: AttentionMetadata, key_cache: torch.Tensor) -> None:
        """Pick the decode backend; for the torch one, build the gather rows, buffers and the
        padding bias (0 or -inf, [B * KVH, G, L]) once per step: every layer reuses them."""
        self.decode_rows = self.decode_key_buffer = self.decode_value_buffer = None
        self.decode_bias = None
        self.causal_biases = {}
        self.sdpa_masks = {}
        if meta.prefills and self.prefill_kernel is not None:
            self._prepare_prefill_kernel(meta, key_cache)
        if meta.decode_block_table is None:
            return
        if self.cpu_kernel is not None:
            check_decode_tables(meta, key_cache.shape[0], key_cache.shape[2])
            self.decode_backend = "cpu_kernel"
            return
        if self.triton is not None:
            self.decode_backend = "triton"
            return
        self.decode_backend = "torch"
        table = meta.decode_block_table
        self.decode_rows = gather_rows(table, self.num_kv_heads).view(-1)
        shape = (self.decode_rows.numel(), key_cache[0, 0].numel())
        self.decode_key_buffer = key_cache.new_empty(shape)
        self.decode_value_buffer = key_cache.new_empty(shape)
        context_len = table.shape[1] * key_cache.shape[2]
        positions = torch.arange(context_len, device=table.device)
        padding = positions[None, :] >= meta.decode_seq_lens[:, None]  # [B, L]
        bias = torch.zeros(
            table.shape[0],
            self.num_kv_heads,
            self.group_size,
            context_len,
            dtype=key_cache.dtype,
            device=key_cache.device,
        )
        bias.masked_fill_(padding[:, None, None, :], float("-inf"))
        self.decode_bias = bias.view(-1, self.group_size, context_len)

    @property
    def reads_only_the_cache(self) -> bool:
        """Decodes and prefills both attend through the CPU kernels, which read this step's
        keys and values from the cache, never from the k and v handed in."""
        return self.cpu_kernel is not None and self.prefill_kernel is not None

    def _prepare_prefill_kernel(self, meta: AttentionMetadata, key_cache: torch.Tensor) -> None:
        """Check the prefill tables and size the kernel's scratch, once per step."""
        num_tokens = meta.slot_blocks.shape[0]
        check_prefill_tables(meta, num_tokens, key_cache.shape[0], key_cache.shape[2])
        self.prefill_threads = torch.get_num_threads()
        needed = cpu_prefill_attention.scratch_floats(
            self.prefill_kernel,
            meta.prefill_chunks,
            self.num_kv_heads,
            self.head_dim,
            self.prefill_threads,
        )
        if self.prefill_scratch.numel() < needed:
            self.prefill_scratch = torch.empty(needed, dtype=torch.float32)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> attention output [T, H * D]. k and v None: the
        caller already stored them in the cache (engine/model/kernels/rope_store.c), which
        only attention that reads the cache alone allows (``reads_only_the_cache``)."""
        if k is None or v is None:
            if not self.reads_only_the_cache:
                raise ValueError("attention needs this step's k and v outside the CPU kernels")
        elif self.triton is not None:
            self.triton.store_kv(k, v, key_cache, value_cache, meta.slot_blocks, meta.slot_offsets)
        else:
            key_cache[meta.slot_blocks, :, meta.slot_offsets] = k
            value_cache[meta.slot_blocks, :, meta.slot_offsets] = v
        if q.stride(-1) != 1 or q.stride(-2) != self.head_dim:
            q = q.contiguous()  # the kernels read [H, D] rows; any stride between tokens
        out = q.new_empty(q.shape)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            self._decode_into(out[:num_decodes], q[:num_decodes], key_cache, value_cache, meta)
        if meta.prefills:
            self._prefill_into(out, q, k, v, key_cache, value_cache, meta)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _prefill_into(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Every prefill chunk into out: all in one call of the CPU kernel, which reads their
        keys (this step's already written) from the cache, or span by span in torch."""
        if self.prefill_kernel is not None:
            cpu_prefill_attention.prefill_attention(
                self.prefill_kernel,
                q,
                key_cache,
                value_cache,
                meta.prefill_block_table,
                meta.prefill_chunks,
                out,
                self.prefill_scratch,
                self.scale,
                self.prefill_threads,
            )
            return
        for span in meta.prefills:
            start, end = span.token_start, span.token_end
            chunks = (q[start:end], k[start:end], v[start:end])
            out[start:end] = self._prefill(*chunks, span, key_cache, value_cache)

    def _gather(
        self, cache: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """rows [..., KVH, n] -> [..., KVH, n * block_size, D] copied out of the cache."""
        flat_cache = cache.view(-1, cache.shape[2] * self.head_dim)
        gathered = torch.index_select(flat_cache, 0, rows.reshape(-1), out=out)
        return gathered.view(*rows.shape[:-1], -1, self.head_dim)

    def _decode_into(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """One query per request, q [B, H, D], through this step's backend into out [B, H, D]."""
        table, seq_lens = meta.decode_block_table, meta.decode_seq_lens
        if self.decode_backend == "cpu_kernel":
            cpu_paged_decode.paged_decode(
                self.cpu_kernel, q, key_cache, value_cache, table, seq_lens, out, self.scale
            )
        elif self.decode_backend == "triton":
            self.triton.paged_decode(q, key_cache, value_cache, table, seq_lens, out, self.scale)
        else:
            out.copy_(self._decode(q, key_cache, value_cache))

    def _decode(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> torch.Tensor:
        """The torch path: one query per request against its gathered blocks, [B, H, D]."""
        num_reqs = q.shape[0]
        rows = self.decode_rows.view(num_reqs, self.num_kv_heads, -1)
        keys = self._gather(key_cache, rows, self.decode_key_buffer)  # [B, KVH, L, D]
        values = self._gather(value_cache, rows, self.decode_value_buffer)
        num_items = num_reqs * self.num_kv_heads
        grouped_q = q.reshape(num_items, self.group_size, self.head_dim)
        context_len = keys.shape[2]
        # scores [B * KVH, G, L]: each KV head serves its group of query heads without a copy;
        # scaling and the padding mask ride in the same call.
        scores = torch.baddbmm(
            self.decode_bias,
            grouped_q,
            keys.view(num_items, context_len, self.head_dim).transpose(1, 2),
            alpha=self.scale,
        )
        probs = torch.softmax(scores, dim=-1)  # accumulates in float32 for 16-bit inputs
        out = torch.bmm(probs, values.view(num_items, context_len, self.head_dim))
        return out.view(num_reqs, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        span: PrefillSpan,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The span's chunks, causal from position span.start, in one call: [T, H, D].
        Chunks of unequal lengths are padded to the longest at their ends (rows gathered by
        padded_rows): a real query never sees a padded key, which comes after it, and the
        padded queries' outputs are dropped."""
        lengths = span.lengths
        num_chunks, length = len(lengths), max(lengths)
        padded = min(lengths) != length
        if padded:
            if span.padding is None:  # once per step: every layer reuses it
                span.padding = padded_rows(lengths, q.device)
            rows = span.padding[0]
            q, k, v = q[rows], k[rows], v[rows]
        shape = (num_chunks, length, self.num_kv_heads, self.head_dim)
        keys, values = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        if span.start:  # [n, KVH, start + length, D]: the cached context, then the chunk
            keys = torch.cat([self._context(key_cache, span), keys], dim=2)
            values = torch.cat([self._context(value_cache, span), values], dim=2)
        out = self._causal(q, keys, values, length, span.start)
        return out[span.padding[1]] if padded else out

    def _context(self, cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
        """Each chunk's cached positions [0, span.start): [n, KVH, start, D]."""
        return self._gather(cache, span.prefix_rows)[:, :, : span.start]

    def _causal(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        length: int,
        offset: int,
    ) -> torch.Tensor:
        """q [n * length, H, D]: n chunks of ``length`` queries at positions offset, ...,
        offset + length - 1; keys/values [n, KVH, offset + length, D]."""
        num_chunks, kvh, context, dim = keys.shape
        if context <= self.plain_prefill_max_len:
            if self.widen_plain_prefill and q.dtype == torch.bfloat16:
                widened = self._causal(q.float(), keys.float(), values.float(), length, offset)
                return widened.to(q.dtype)
            # Each KV head's group of query heads stacked position-major (row p * G + g).
            group = self.group_size
            grouped_q = q.reshape(num_chunks, length, kvh, group, dim).transpose(1, 2)
            grouped_q = grouped_q.reshape(num_chunks * kvh, length * group, dim)
            flat = (num_chunks * kvh, context, dim)
            out = self._grouped_causal(
                grouped_q, keys.reshape(flat), values.reshape(flat), length, offset
            )
            return out.view(num_chunks, kvh, length, group, dim).transpose(1, 2).reshape(q.shape)
        backends = (
            sdpa_kernel(self.sdpa_backends) if self.sdpa_backends else contextlib.nullcontext()
        )
        with backends:
            out = F.scaled_dot_product_attention(
                q.view(num_chunks, length, self.num_heads, dim).transpose(1, 2),
                keys,
                values,
                attn_mask=self._sdpa_mask(offset, length, q.device) if offset else None,
                is_causal=not offset,
                scale=self.scale,
                enable_gqa=self.group_size > 1,
            )
        return out.transpose(1, 2).reshape(q.shape)

    def _grouped_causal(
        self,
        grouped_q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        length: int,
        offset: int,
    ) -> torch.Tensor:
        """grouped_q [B * KVH, length * G, D] at positions offset, offset + 1, ...; keys and
        values [B * KVH, >= offset + length, D]. QUERY_CHUNK positions at a time attend only
        to the keys up to their last one."""
        group = self.group_size
        out = torch.empty_like(grouped_q)
        for start in range(0, length, QUERY_CHUNK):
            end = min(start + QUERY_CHUNK, length)
            rows = slice(start * group, end * group)
            last = offset + end
            scores = torch.baddbmm(
                self._causal_bias(offset + start, last, grouped_q),
                grouped_q[:, rows],
                keys[:, :last].transpose(1, 2),
                alpha=self.scale,
            )
            out[:, rows] = torch.bmm(torch.softmax(scores, dim=-1), values[:, :last])
        return out

    def _causal_bias(self, start: int, end: int, like: torch.Tensor) -> torch.Tensor:
        """[(end - start) * G, end]: row (p - start) * G + g is 0 where position p may see the
        key, -inf after p. Built once per step and chunk."""
        bias = self.causal_biases.get((start, end))
        if bias is None:
            positions = torch.arange(start, end, device=like.device).repeat_interleave(
                self.group_size
            )
            future = torch.arange(end, device=like.device)[None, :] > positions[:, None]
            bias = torch.zeros(future.shape, dtype=like.dtype, device=like.device)
            self.causal_biases[(start, end)] = bias.masked_fill_(future, float("-inf"))
        return bias

    def _sdpa_mask(self, offset: int, length: int, device: torch.device) -> torch.Tensor:
        """[length, offset + length]: query i (position offset + i) sees keys up to its own
        position. Built once per step and shape."""
        mask = self.sdpa_masks.get((offset, length))
        if mask is None:
            positions = torch.arange(offset, offset + length, device=device)
            keys = torch.arange(offset + length, device=device)
            mask = self.sdpa_masks[(offset, length)] = keys[None, :] <= positions[:, None]
        return mask


def padded_rows(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For chunks of ``lengths`` tokens back to back: the rows that lay them out padded to the
    longest (a pad repeats its chunk's last token), and which padded rows are real."""
    longest = max(lengths)
    positions = torch.arange(longest)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    ends = torch.tensor(lengths)
    rows = starts[:, None] + torch.minimum(positions[None, :], ends[:, None] - 1)
    real = (positions[None, :] < ends[:, None]).flatten()
    return rows.flatten().to(device), real.nonzero().flatten().to(device)


def _triton_kernels(device: torch.device) -> ModuleType | None:
    """engine/model/kernels/triton_paged.py when it exists and runs on this CUDA device."""
    if device.type != "cuda":
        return None
    try:
        from engine.model.kernels import triton_paged
    except ImportError:  # not written yet, or triton missing: the torch path
        return None
    return triton_paged if triton_paged.available(device) else None
