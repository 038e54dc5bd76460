"""Sources of the lane other than our engine: vLLM's stat-logger plugin and its mapping of
vLLM's stats onto the record.
"""
