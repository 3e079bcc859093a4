"""Errors a trainer raises on purpose; each carries a stable code and its exit status.

Recipes raise these for conditions the user can act on; the entry point
(`trainers.__main__`) turns them into the termination message and the exit code.
"""

from __future__ import annotations

from trainers.exit_codes import ExitCode


class TrainerError(Exception):
    """Base class: a failure with a stable, user-visible code."""

    exit_code: ExitCode = ExitCode.INTERNAL_ERROR
    code: str = "trainer_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class UserError(TrainerError):
    """Bad data, configuration or model: retrying will not help; the user must fix it.

    Typical codes: ``invalid_spec``, ``model_not_found``, ``corrupt_model``,
    ``unsupported_architecture``, ``dataset_not_found``, ``invalid_dataset``,
    ``nan_loss``, ``invalid_parallelism``, ``offload_requires_accelerator``; for
    reinforcement fine-tuning ``method_unsupported`` (its prompts read as supervised data),
    ``reinforcement_multi_rank`` (the torch trainer), ``invalid_grader``, ``grader_unavailable``;
    for a job that continues a fine-tuned model ``parent_adapter_not_found``,
    ``invalid_parent_adapter``, ``parent_adapter_mismatch`` (``trainers.common.lineage``).
    """

    exit_code = ExitCode.USER_ERROR
    code = "user_error"


class OutOfMemory(TrainerError):
    exit_code = ExitCode.OUT_OF_MEMORY
    code = "out_of_memory"


class Preempted(TrainerError):
    """Raised inside the loop after SIGTERM, once the checkpoint is written."""

    exit_code = ExitCode.PREEMPTED
    code = "preempted"


class DiskFull(TrainerError):
    exit_code = ExitCode.USER_ERROR
    code = "disk_full"
