"""Trainers: the contract (spec.py) and the two recipes. Never imports api or worker."""
