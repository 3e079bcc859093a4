"""OpenAI's grader endpoints: ``POST /v1/fine_tuning/alpha/graders/validate`` and ``/run``."""
