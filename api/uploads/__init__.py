"""OpenAI's Uploads: a file larger than one request, sent in parts and put together into
a File (routes, commands, queries, schemas, assembly)."""
