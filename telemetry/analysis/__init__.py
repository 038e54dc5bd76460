"""Offline analysis of a recording: timelines, episodes, findings, `explain`, `tune`, plots.

It reads recordings through the lane's format and never imports the sidecar.
"""
