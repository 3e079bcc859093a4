"""Fine-tuning jobs: routes, commands (create, cancel, pause, resume), queries, the
lifecycle's state machine, the cached list pages and the job schemas.
"""
