"""Moved to tests/helpers/sink_feed.py; this module only re-exports it for
tests/test_vllm_records.py, which still imports it from here. Import from
tests.helpers.sink_feed instead; delete this file when nothing imports it."""

from tests.helpers.sink_feed import send, set_status, view_of

__all__ = ["send", "set_status", "view_of"]
