"""Engine-side NVTX markers (``--nvtx-markers``): one range per iteration around the step.

The message is the constant string "iteration" and the payload is the iteration number, the
same number the sidecar's range for that iteration carries (telemetry/sidecar/sinks/nvtx_ranges.py),
so in Nsight Systems the engine's exact range and the sidecar's descriptive one pair up by
payload. Nothing is formatted here: the event attributes are built once and only the int64
payload changes per iteration.

When markers are off, or no NVTX tool (Nsight Systems) is attached to the process, the core
gets NullMarkers, whose calls do nothing. Use in the core loop:

    markers.begin(iteration)   # before scheduling
    ...                        # schedule, forward, update, publish the record
    markers.end()
"""

from __future__ import annotations

DOMAIN = "iterscope"
MESSAGE = "iteration"
COLOR = 0xFF1F77B4  # ARGB


class NullMarkers:
    """Markers off: the same calls, nothing done."""

    def begin(self, iteration: int) -> None:
        pass

    def end(self) -> None:
        pass


class NvtxMarkers:
    """Push/pop one NVTX range per iteration in domain ``iterscope``, payload = iteration."""

    def __init__(self, domain) -> None:
        from nvtx._lib.lib import pop_range, push_range

        self._handle = domain.handle
        self._attributes = domain.get_event_attributes(message=MESSAGE, color=COLOR, payload=0)
        self._push_range = push_range
        self._pop_range = pop_range

    def begin(self, iteration: int) -> None:
        self._attributes.payload = iteration
        self._push_range(self._attributes, self._handle)

    def end(self) -> None:
        self._pop_range(self._handle)


def make_markers(enabled: bool) -> NvtxMarkers | NullMarkers:
    """NvtxMarkers when asked for and an NVTX tool is attached, else NullMarkers."""
    if not enabled:
        return NullMarkers()
    import nvtx
    from nvtx._lib.lib import DummyDomain

    domain = nvtx.get_domain(DOMAIN)
    if isinstance(domain, DummyDomain):  # no tool attached: every NVTX call would be a no-op
        return NullMarkers()
    return NvtxMarkers(domain)
