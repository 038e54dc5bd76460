"""Long prefill chunks (telemetry/analysis/episodes/long_prefill.py), beside a slowdown from
outside the batch."""

from scenarios.synthetic import Row, scripted

from telemetry.analysis.episodes import Thresholds, detect_episodes, detect_long_prefill
from telemetry.analysis.timeline import build_timelines


def cycle(num_decodes: int, decode_s: float, chunk_s: float) -> list[Row]:
    """``num_decodes`` decode-only iterations of 4 requests, then one with a 192-token chunk."""
    decodes = [Row(decode_s, running=4, waiting=0, blocks_used=10, gen_reqs=4)] * num_decodes
    chunk = Row(chunk_s, running=5, waiting=0, blocks_used=12, gen_reqs=4, ctx_tokens=192)
    return [*decodes, chunk]


def test_a_chunk_in_a_slowdown_is_the_slowdown_s_not_a_long_prefill():
    """Decodes of 20 ms and a 192-token chunk of 120 ms every 10 s, then for 56 s every
    iteration 10x slower (another job on the cores), then as before. Once the slowdown had
    lasted 30 s, the chunks before any chunk in it were all slowed too, so its 1.5 s chunks
    read as chunks costing 6.8 ms a token: five "long prefill chunks" with an action to lower
    the token budget, which could not have shortened them. They are the slowdown's."""
    normal = cycle(499, 0.020, 0.120) * 4
    rows = normal + cycle(49, 0.200, 1.5) * 5 + normal
    timeline = build_timelines(scripted(rows))[0]
    assert [episode.kind for episode in detect_episodes(timeline)] == ["slow_decode"]
    # the same chunks at the pace before are no long prefill either (0.2% of the steps)
    assert detect_long_prefill(build_timelines(scripted(normal * 3))[0], Thresholds()) == []


def test_an_off_pace_blip_alone_leaves_a_chunk_judged():
    """A decode-only iteration 2.5x its baseline (off pace, not slowed) just before a chunk
    of 1.5 s: no slowdown shown, so the chunk is judged as ever, and found."""
    blip = Row(0.050, running=4, waiting=0, blocks_used=10, gen_reqs=4)
    rows = cycle(1499, 0.020, 0.120) + [blip] + cycle(10, 0.020, 1.5) + cycle(499, 0.020, 0.120)
    timeline = build_timelines(scripted(rows))[0]
    (episode,) = detect_long_prefill(timeline, Thresholds())
    assert "took up to 1.50 s" in episode.evidence
