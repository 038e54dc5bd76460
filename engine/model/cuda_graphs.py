"""Decode-only steps on CUDA replayed from CUDA graphs: one launch instead of ~15 per layer.

Measured on an H200 (docs/performance.md), an eager decode step of SmolLM2-135M took 10-11 ms
at every batch from 1 to 256: the time to launch its kernels from Python, not the GPU's. A
graph captured once per batch bucket replays the whole forward pass with one launch.

A graph reads and writes fixed addresses, so each step's inputs are copied into static buffers
sized for the largest bucket, and a step of B requests runs the graph of the smallest bucket
>= B with the rows past B padded: no KV write (store_kv skips a slot block < 0), one position
of attention over block 0 (read, never written), output discarded. The decode block table has
one column per block of the longest request (max_model_len); columns past a request's length
are never read (the kernel stops at seq_len). Steps with a prefill, or more requests than the
largest bucket, run eagerly.

Only the Triton backend is captured: its launches never synchronise with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.attention_metadata import AttentionMetadata

NO_SLOT = -1  # store_kv skips a token whose slot block is < 0


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (which is always the last)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return [*buckets, max_batch]


@dataclass
class StaticInputs:
    """The buffers every graph reads: [max_batch] ids, positions, slots and lengths, and a
    [max_batch, max_blocks] block table."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> StaticInputs:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        static = cls(longs(max_batch), longs(max_batch), longs(max_batch), longs(max_batch),
                     longs(max_batch), longs(max_batch, max_blocks))  # fmt: skip
        static.pad(0)
        return static

    def pad(self, first_row: int) -> None:
        """Rows from first_row on: a token that writes nothing and attends to one position."""
        self.input_ids[first_row:] = 0
        self.positions[first_row:] = 0
        self.slot_blocks[first_row:] = NO_SLOT
        self.slot_offsets[first_row:] = 0
        self.seq_lens[first_row:] = 1
        self.block_table[first_row:] = 0

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             bucket: int) -> None:  # fmt: skip
        """This step's B decodes into rows [0, B), and rows [B, bucket) padded."""
        num = meta.num_decode_tokens
        width = meta.decode_block_table.shape[1]
        self.input_ids[:num].copy_(input_ids, non_blocking=True)
        self.positions[:num].copy_(positions, non_blocking=True)
        self.slot_blocks[:num].copy_(meta.slot_blocks, non_blocking=True)
        self.slot_offsets[:num].copy_(meta.slot_offsets, non_blocking=True)
        self.seq_lens[:num].copy_(meta.decode_seq_lens, non_blocking=True)
        self.block_table[:num, :width].copy_(meta.decode_block_table, non_blocking=True)
        if bucket > num:
            self.pad(num)

    def meta(self, bucket: int) -> AttentionMetadata:
        """The metadata of a bucket's graph: views of the first ``bucket`` rows."""
        return AttentionMetadata(
            slot_blocks=self.slot_blocks[:bucket],
            slot_offsets=self.slot_offsets[:bucket],
            num_decode_tokens=bucket,
            decode_block_table=self.block_table[:bucket],
            decode_seq_lens=self.seq_lens[:bucket],
            prefills=[],
        )


class DecodeGraphs:
    """Captured decode-only forward passes of ``decoder`` over ``kv_cache``, by batch bucket."""

    def __init__(self, decoder, kv_cache: torch.Tensor, max_batch: int, max_blocks: int) -> None:
        self.decoder = decoder
        self.kv_cache = kv_cache
        self.max_blocks = max_blocks
        self.buckets = batch_buckets(max_batch)
        self.static = StaticInputs.allocate(max_batch, max_blocks, kv_cache.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (they never run at
        once). The padded static inputs write no KV while being captured."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._warm_up(bucket)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward_static(bucket)
            self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize()

    def _warm_up(self, bucket: int) -> None:
        """Run once outside capture on a side stream (Triton compiles, allocators settle)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward_static(bucket)
        torch.cuda.current_stream().wait_stream(stream)

    def forward_static(self, bucket: int) -> torch.Tensor:
        """The forward pass a bucket's graph holds, over the static inputs (run eagerly, it is
        what a replay computes: tests compare it with the step's own forward pass)."""
        static = self.static
        return self.decoder.forward(
            static.input_ids[:bucket], static.positions[:bucket], static.meta(bucket),
            self.kv_cache,
        )  # fmt: skip

    def bucket_for(self, meta: AttentionMetadata) -> int | None:
        """The bucket a step replays in, or None when it must run eagerly."""
        if meta.prefills or meta.decode_block_table is None:
            return None
        if meta.decode_block_table.shape[1] > self.max_blocks:
            return None
        num = meta.num_decode_tokens
        return next((b for b in self.buckets if b >= num and b in self.graphs), None)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               bucket: int) -> torch.Tensor:  # fmt: skip
        """The step's final hidden states [B, hidden], from the bucket's graph."""
        self.static.fill(input_ids, positions, meta, bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden[: meta.num_decode_tokens]
