"""Liveness and readiness, and the worker heartbeat readiness reads.
"""
