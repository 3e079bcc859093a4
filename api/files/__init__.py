"""Training files: routes, commands (upload, delete, expiry, result files), queries,
the streamed multipart upload, validation and the file schemas.
"""
