"""Parts shared by both trainers: data formats, tokenization, reporting, checkpoints, export."""
