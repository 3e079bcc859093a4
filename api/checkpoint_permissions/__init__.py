"""Checkpoint permissions: a tenant shares a fine-tuned model or one of its checkpoints
with other tenants of this service, as OpenAI's ``checkpoint.permission`` shares one with
other projects (routes, commands, queries, schemas)."""
