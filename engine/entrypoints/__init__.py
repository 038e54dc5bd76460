"""The product's commands, above the engine and telemetry: the `iterscope` CLI, the
OpenAI-compatible server, demo, the load client and kv-plan.

This layer may import anything; the engine package never imports it, and it is the only
engine code that starts a sidecar.
"""
