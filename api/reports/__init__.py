"""The internal report endpoint trainers post to: authentication by job token,
applying a batch (metrics, checkpoints, artifacts, events), schemas.
"""
