"""The telemetry lane: the record schema, the publisher that sends it without ever blocking,
CURVE keys, the checks a received frame must pass and the recording file format.

Everything else imports the lane; the lane imports nothing else of this project.
"""
