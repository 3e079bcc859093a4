"""Scheduling: node pools, memory-fit estimator, placement, the scheduling cycle."""
