"""Held-out evaluations of a succeeded job: base and fine-tuned models answer a file's rows, graded."""
