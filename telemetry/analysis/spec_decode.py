"""Speculative decoding as a recording saw it: drafts scored, tokens accepted, and what that
means per decoding request, for `explain`'s summary and `tune`'s limits.

A decoding request in an iteration (a request-step) computes its one token and its draft
tokens, and produces that token and the draft tokens accepted (a draft is accepted up to its
first rejected token). A request whose proposer found no draft (an n-gram without a match)
computes and produces one token; it is a request-step without a draft. vLLM's own figures
are per draft (``mean acceptance length`` = 1 + accepted / drafts, per-position rates over
drafts: vllm/v1/spec_decode/metrics.py); `tune` needs them per request-step, drafting or not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from telemetry.analysis.timeline import EngineTimeline


@dataclass
class Drafts:
    """A recording's speculative decoding, summed over its iterations."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_decode_steps: int  # request-steps: decoding requests summed over iterations
    max_draft_tokens: int  # the largest mean draft of one iteration, rounded up
    # Accepted tokens by position in the draft (first first); empty unless asked for.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token scored."""
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's: tokens a draft yields, its accepted tokens and the request's own one."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def draft_tokens_per_decode(self) -> float:
        """Mean draft tokens a decoding request computes per iteration, beside its own one."""
        return self.num_draft_tokens / self.num_decode_steps

    @property
    def output_tokens_per_decode(self) -> float:
        """Mean tokens a decoding request gets per iteration: 1 + its accepted tokens."""
        return 1 + self.num_accepted_tokens / self.num_decode_steps

    def to_json(self) -> dict:
        """The counts and the figures derived from them, as `explain --json` and `tune
        --json` print them (the accepted tokens by position where they were asked for)."""
        counts = asdict(self)
        if not self.num_accepted_tokens_per_pos:
            del counts["num_accepted_tokens_per_pos"]
        return {
            **counts,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_tokens_per_decode": self.draft_tokens_per_decode,
            "output_tokens_per_decode": self.output_tokens_per_decode,
        }


def draft_slots(drafts: Drafts | None) -> int:
    """Budget tokens a decoding request takes beside its own one: k, 0 without drafts."""
    return drafts.max_draft_tokens if drafts else 0


def output_tokens_per_decode(drafts: Drafts | None) -> float:
    """Tokens a decoding request gets per iteration: 1 + mean accepted, 1.0 without drafts."""
    return drafts.output_tokens_per_decode if drafts else 1.0


def recorded_drafts(tl: EngineTimeline, per_position: bool = False) -> Drafts | None:
    """The timeline's speculative decoding; None where no iteration scored a draft.
    ``per_position``: with the accepted tokens by position (a pass over the records). Every
    draft is a decoding request's, so request-steps are never fewer than drafts (a source
    that counts decoding requests short cannot make a request yield more than it did)."""
    drafts = tl.col("num_drafts")
    if not drafts.any():
        return None
    drafting = drafts > 0
    mean_drafts_up = -(-tl.col("num_draft_tokens")[drafting] // drafts[drafting])
    num_drafts = int(drafts.sum())
    return Drafts(
        num_drafts=num_drafts,
        num_draft_tokens=int(tl.col("num_draft_tokens").sum()),
        num_accepted_tokens=int(tl.col("num_accepted_tokens").sum()),
        num_decode_steps=max(int(tl.col("num_decode_reqs").sum()), num_drafts),
        max_draft_tokens=int(mean_drafts_up.max()),
        num_accepted_tokens_per_pos=_accepted_per_position(tl) if per_position else [],
    )


def _accepted_per_position(tl: EngineTimeline) -> list[int]:
    """Accepted tokens by position in the draft (first first), summed over the records."""
    total = np.zeros(0, dtype=np.int64)
    for record in tl.records:
        if record.spec_decode is None:
            continue
        counts = np.asarray(record.spec_decode.num_accepted_tokens_per_pos, dtype=np.int64)
        if len(counts) > len(total):
            total = np.pad(total, (0, len(counts) - len(total)))
        total[: len(counts)] += counts
    return total.tolist()


def summary_line(drafts: Drafts) -> str:
    """explain's summary line, in vLLM's figures (per draft), then per decoding request."""
    per_position = drafts.num_accepted_tokens_per_pos
    rates = ", ".join(f"{n / max(drafts.num_drafts, 1):.3f}" for n in per_position)
    line = (
        f"speculative decoding: {drafts.num_draft_tokens} draft tokens in {drafts.num_drafts} "
        f"drafts, {drafts.num_accepted_tokens} accepted ({100 * drafts.acceptance_rate:.1f}%), "
        f"mean acceptance length {drafts.mean_acceptance_length:.2f}"
    )
    if rates:
        line += f"; per position {rates}"
    return (
        f"{line}; decoding requests got {drafts.output_tokens_per_decode:.2f} tokens per "
        "iteration on average"
    )
