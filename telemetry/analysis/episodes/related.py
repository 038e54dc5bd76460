"""Episodes that say why another happened: a queue that formed while the engine was slowed
from outside its batch.

A waiting episode says which limit held requests back (queues.py), and its action raises that
limit; where it began while decode iterations were slowed from outside the batch (a
slow_decode episode), the engine had kept up with the same arrivals just before, and the
queue formed because another job took its time: the waiting episode's evidence says so
(``numbers["began_slowed"]``), and its action to free the engine's cores or device first
(actions.finding_action). (Another job that made every other iteration 5x slower for 90 s
made 11,500 request-s of waiting, "Requests waiting: --max-num-seqs" first, and an action to
raise it, with nothing that tied the queue to the slowdown.)

One rule for explain (episodes.detect_episodes) and the live sidecar (live_findings), over
the episodes each found.
"""

from __future__ import annotations

from telemetry.analysis.episodes.episode import INFO, Episode

SLOWED_QUEUE_TEXT = (
    "; it began while decode iterations were slowed from outside the batch (the slowed-decode "
    "finding): the engine served the same work more slowly than just before, so requests it "
    "had kept up with queued"
)


def note_slowed_queues(episodes: list[Episode]) -> None:
    """Says, in the evidence of each waiting episode of ``episodes`` that began during a
    slow_decode episode among them (not an INFO one), that it began then."""
    slowdowns = [
        (episode.start_ns, episode.end_ns)
        for episode in episodes
        if episode.kind == "slow_decode" and episode.severity != INFO
    ]
    for episode in episodes:
        if episode.kind != "waiting" or episode.numbers.get("began_slowed"):
            continue
        if any(start <= episode.start_ns <= end for start, end in slowdowns):
            episode.evidence += SLOWED_QUEUE_TEXT
            episode.numbers["began_slowed"] = True
