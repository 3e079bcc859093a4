"""What a job produces: events, checkpoints, metrics, logs, artifacts, exports and
the live stream, their routes and schemas.
"""
