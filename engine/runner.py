"""ModelRunner: turns the scheduler's (request, num_new_tokens) pairs into one forward pass.

For each scheduled request, positions [num_computed_tokens, num_computed_tokens + n) of
request.token_ids are computed; their K/V go to slot

    block_ids[p // block_size] * block_size + p % block_size

and attention covers positions [0, num_computed_tokens + n) through the block table. A request
whose computed range reaches len(token_ids) gets one sampled token; others (chunks of a longer
prompt) get None. Requests are read, never mutated, but for the sampled token's logprobs
(request.sampled_logprobs) when asked for: the engine advances num_computed_tokens and appends
the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.attention_metadata import AttentionMetadata, PrefillSpan, gather_rows
from engine.model.cuda_graphs import DecodeGraphs
from engine.model.loader import LoadedModel
from engine.request import Request
from engine.sampler import Sampler


@dataclass
class StepInputs:
    """One step's flat inputs; `order[i]` is the scheduled index of the i-th request laid out."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[int]
    token_starts: list[int]  # flat index of each laid-out request's first token
    sample_rows: list[int]  # laid-out request indices that get a token
    sample_token_indices: torch.Tensor  # flat index of their last token


@dataclass(slots=True)
class _FlatLayout:
    """A step laid out flat as prepare builds it, before the lists become tensors: the token
    ids, each laid-out request's first flat index, the rows that sample and the flat index of
    their last token; positions and slot blocks in chunks (the decodes' first, then one per
    prefill); the decodes' sequence lengths and block-table rows; the prefills' spans."""

    input_ids: list[int]
    token_starts: list[int]
    sample_rows: list[int]
    sample_indices: list[int]
    position_chunks: list[torch.Tensor]
    block_chunks: list[torch.Tensor]
    decode_seq_lens: list[int]
    decode_block_rows: list[list[int]]
    prefill_spans: list[PrefillSpan] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)  # flat, start, n
    prefill_block_rows: list[list[int]] = field(default_factory=list)


PAD_WASTE = 8  # batched fresh chunks may differ in length by 1/8 of the longest


class ModelRunner:
    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, device: str) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        cfg = model.config
        self.model = model
        self.decoder = model.decoder
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.num_kv_heads = cfg.num_kv_heads
        # Head-major blocks: see engine/model/attention.py.
        shape = (cfg.num_layers, 2, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=cfg.dtype, device=self.device)
        self.sampler = Sampler(eos_token_ids=cfg.eos_token_ids)
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> list[int] | None:
        """On CUDA with the Triton decode kernels: capture decode-only steps of up to
        ``max_batch`` requests as CUDA graphs (engine/model/cuda_graphs.py); the batch buckets
        captured, or None where they cannot be used."""
        if self.device.type != "cuda" or self.decoder.attention.triton is None:
            return None
        max_blocks = -(-max_model_len // self.block_size)
        with torch.inference_mode():  # the static inputs too: steps fill them in this mode
            graphs = DecodeGraphs(self.decoder, self.kv_cache, max_batch, max_blocks)
            graphs.capture()
        self.decode_graphs = graphs
        return graphs.buckets

    def cpu_kernels_line(self) -> str:
        """The start-up line naming the CPU kernels the model runs (engine/model/decoder.py)."""
        return self.decoder.cpu_kernels_line()

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> list[int | None]:
        """Run one step: a sampled token per scheduled request, None for an unfinished prompt."""
        results: list[int | None] = [None] * len(scheduled)
        if not scheduled:
            return results
        inputs = self.prepare(scheduled)
        hidden = self._forward(inputs)
        if not inputs.sample_rows:
            return results
        logits = self.decoder.compute_logits(hidden[inputs.sample_token_indices])
        requests = [scheduled[inputs.order[row]][0] for row in inputs.sample_rows]
        tokens, logprobs = self.sampler.sample(logits, requests)
        for row, request, token, entry in zip(
            inputs.sample_rows, requests, tokens, logprobs, strict=True
        ):
            results[inputs.order[row]] = token
            request.sampled_logprobs = entry
        return results

    @torch.inference_mode()
    def compute_logits(self, scheduled: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """Like execute, but returns float32 logits [n, vocab] of every new position (tests)."""
        inputs = self.prepare(scheduled)
        hidden = self._forward(inputs)
        logits = self.decoder.compute_logits(hidden)
        results: list[torch.Tensor] = [torch.empty(0)] * len(scheduled)
        for row, index in enumerate(inputs.order):
            start = inputs.token_starts[row]
            results[index] = logits[start : start + scheduled[index][1]]
        return results

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(inputs.meta) if graphs is not None else None
        if bucket is not None:
            return graphs.replay(inputs.input_ids, inputs.positions, inputs.meta, bucket)
        return self.decoder.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache)

    def prepare(self, scheduled: list[tuple[Request, int]]) -> StepInputs:
        """Lay the step out flat, decodes (n == 1) first, and build the attention metadata."""
        for request, num_new in scheduled:
            self._check(request, num_new)
        decodes = [i for i, (_, n) in enumerate(scheduled) if n == 1]
        prefills = [i for i, (_, n) in enumerate(scheduled) if n > 1]
        layout = self._lay_out_decodes(scheduled, decodes)
        self._lay_out_prefills(scheduled, prefills, len(decodes), layout)
        all_positions = torch.cat(layout.position_chunks)
        meta = self._attention_metadata(layout, all_positions, len(decodes))
        return StepInputs(
            input_ids=torch.tensor(layout.input_ids, dtype=torch.long).to(self.device),
            positions=all_positions.to(self.device),
            meta=meta,
            order=decodes + prefills,
            token_starts=layout.token_starts,
            sample_rows=layout.sample_rows,
            sample_token_indices=torch.tensor(layout.sample_indices, dtype=torch.long).to(
                self.device
            ),
        )

    def _lay_out_decodes(
        self, scheduled: list[tuple[Request, int]], decodes: list[int]
    ) -> _FlatLayout:
        """The decodes, one token each and first in the step, so a decode's row is also its
        flat index; their positions and slot blocks make the layout's first chunks."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        token_starts: list[int] = []
        sample_rows: list[int] = []
        sample_indices: list[int] = []
        seq_lens: list[int] = []
        block_rows: list[list[int]] = []
        for row, index in enumerate(decodes):
            request = scheduled[index][0]
            pos = request.num_computed_tokens
            input_ids.append(request.token_ids[pos])
            positions.append(pos)
            blocks.append(request.block_ids[pos // bs])
            token_starts.append(row)
            seq_lens.append(pos + 1)
            block_rows.append(request.block_ids[: pos // bs + 1])
            if pos + 1 == len(request.token_ids):
                sample_rows.append(row)
                sample_indices.append(row)
        return _FlatLayout(
            input_ids,
            token_starts,
            sample_rows,
            sample_indices,
            position_chunks=[torch.tensor(positions, dtype=torch.long)],
            block_chunks=[torch.tensor(blocks, dtype=torch.long)],
            decode_seq_lens=seq_lens,
            decode_block_rows=block_rows,
        )

    def _lay_out_prefills(
        self,
        scheduled: list[tuple[Request, int]],
        prefills: list[int],
        first_row: int,
        layout: _FlatLayout,
    ) -> None:
        """Append each prefill chunk after the decodes: its tokens, a chunk of positions and
        of slot blocks, and its attention span (merged with the previous one when they can
        share one attention call)."""
        bs = self.block_size
        spans = layout.prefill_spans
        for row, index in enumerate(prefills, start=first_row):
            request, num_new = scheduled[index]
            start = request.num_computed_tokens
            end = start + num_new
            flat_start = len(layout.input_ids)
            layout.input_ids.extend(request.token_ids[start:end])
            layout.token_starts.append(flat_start)
            span_positions = torch.arange(start, end)
            layout.position_chunks.append(span_positions)
            block_ids = request.block_ids[: (end + bs - 1) // bs]
            layout.prefill_chunks.append((flat_start, start, num_new))
            layout.prefill_block_rows.append(block_ids)
            request_blocks = torch.tensor(block_ids)
            layout.block_chunks.append(request_blocks[span_positions // bs])
            span = self._prefill_span(flat_start, request_blocks, start, end)
            if spans and _can_batch(spans[-1], span):
                merged = spans[-1]
                merged.token_end = span.token_end
                merged.lengths += span.lengths
                if span.prefix_rows is not None:
                    merged.prefix_rows = torch.cat([merged.prefix_rows, span.prefix_rows])
            else:
                spans.append(span)
            if end == len(request.token_ids):
                layout.sample_rows.append(row)
                layout.sample_indices.append(flat_start + num_new - 1)

    def _attention_metadata(
        self, layout: _FlatLayout, all_positions: torch.Tensor, num_decodes: int
    ) -> AttentionMetadata:
        """Every new token's cache slot, the decodes' padded block table and lengths, and
        each prefill chunk's place and blocks (the CPU prefill kernel's tables)."""
        meta = AttentionMetadata(
            slot_blocks=torch.cat(layout.block_chunks).to(self.device),
            slot_offsets=(all_positions % self.block_size).to(self.device),
            num_decode_tokens=num_decodes,
            decode_block_table=None,
            decode_seq_lens=None,
            prefills=layout.prefill_spans,
        )
        if num_decodes:
            block_rows = layout.decode_block_rows
            meta.decode_block_table = _padded_table(block_rows).to(self.device)
            meta.decode_seq_lens = torch.tensor(layout.decode_seq_lens, dtype=torch.long).to(
                self.device
            )
        if layout.prefill_chunks:
            chunks = torch.tensor(layout.prefill_chunks, dtype=torch.long)
            meta.prefill_chunks = chunks.T.contiguous()
            meta.prefill_block_table = _padded_table(layout.prefill_block_rows)
        return meta

    def _prefill_span(
        self, flat_start: int, request_blocks: torch.Tensor, start: int, end: int
    ) -> PrefillSpan:
        """A chunk from position 0 attends to itself; a later one also to [0, start) in the
        cache, read through the blocks that hold it."""
        span = PrefillSpan(flat_start, flat_start + end - start, start, [end - start])
        if start:
            prefix_blocks = request_blocks[: (start + self.block_size - 1) // self.block_size]
            span.prefix_rows = gather_rows(prefix_blocks, self.num_kv_heads)[None].to(self.device)
        return span

    def _check(self, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        if num_new < 1 or end > len(request.token_ids):
            raise ValueError(
                f"request {request.request_id!r}: cannot compute {num_new} tokens from position "
                f"{start} of {len(request.token_ids)}"
            )
        if len(request.block_ids) * self.block_size < end:
            raise ValueError(
                f"request {request.request_id!r}: {len(request.block_ids)} blocks of "
                f"{self.block_size} cannot hold {end} positions"
            )
        if end > self.model.config.max_position_embeddings:
            raise ValueError(
                f"request {request.request_id!r}: {end} positions exceed the model's "
                f"max_position_embeddings ({self.model.config.max_position_embeddings})"
            )


def _padded_table(block_rows: list[list[int]]) -> torch.Tensor:
    """int64 [rows, longest], each row padded with block 0."""
    max_blocks = max(len(row) for row in block_rows)
    padded = [row + [0] * (max_blocks - len(row)) for row in block_rows]
    return torch.tensor(padded, dtype=torch.long)


def _can_batch(previous: PrefillSpan, span: PrefillSpan) -> bool:
    """Chunks next to each other that start at the same position (fresh prompts; prompts
    over the same cached chat template) share one attention call when padding each to the
    longest wastes at most 1/PAD_WASTE of it (a chat template's prompts differ by a few
    tokens: one call instead of one per prompt and query chunk, in every layer)."""
    if previous.start != span.start:
        return False
    lengths = previous.lengths + span.lengths
    return max(lengths) - min(lengths) <= max(lengths) // PAD_WASTE
