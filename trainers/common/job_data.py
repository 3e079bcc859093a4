"""A job's datasets and tokenizer, from the spec to :class:`~trainers.common.data.TrainingData`.

Both recipes call these so that a missing or broken file fails the same way, with the
same stable codes (``trainers.errors.UserError``):

- ``dataset_not_found``: the train/validation file does not exist;
- ``invalid_dataset``: a line is not a valid example of the spec's format (the service
  validates uploads, so this means the file changed or the spec's format is wrong), the
  model's chat template refuses an example (e.g. one that takes a single tool call per
  message), or nothing trainable is left after truncation;
- ``model_not_found`` / ``corrupt_model``: the tokenizer cannot be loaded from the model dir;
- ``unsupported_location``: an ``s3://`` location reached a recipe (the entry point,
  ``trainers.__main__``, stages s3:// inputs into a local cache and hands the recipe a
  spec with local paths: ``trainers.common.storage``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.common.data import ChatTemplateError, TokenizedDataset, TrainingData, tokenize_dataset
from trainers.common.formats import FormatError, read_examples
from trainers.errors import UserError


def local_path(location: str, *, what: str, missing_code: str) -> Path:
    """A spec location as a local Path that exists (UserError otherwise)."""
    if "://" in location:
        raise UserError(
            f"{what} {location!r} is a remote URI; recipes read local paths (start the trainer "
            "with `python -m trainers --spec`, which stages s3:// locations first)",
            code="unsupported_location",
        )
    path = Path(location)
    if not path.exists():
        raise UserError(f"{what} not found: {location}", code=missing_code)
    return path


def check_inputs_exist(spec: Any) -> None:
    """Fail fast, before loading a model, if a dataset or the model directory is missing."""
    local_path(spec.data.train_file, what="training file", missing_code="dataset_not_found")
    if spec.data.validation_file:
        local_path(spec.data.validation_file, what="validation file", missing_code="dataset_not_found")
    model_dir = local_path(spec.model.path, what="model directory", missing_code="model_not_found")
    if not model_dir.is_dir():
        raise UserError(f"model path is not a directory: {model_dir}", code="model_not_found")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's Hugging Face tokenizer (with a pad token: eos if it defines none)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot load the tokenizer from {model_dir}: {exc}", code="corrupt_model") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenize_file(path: str | Path, fmt: str, tokenizer: Any, max_seq_len: int) -> TokenizedDataset:
    try:
        dataset = tokenize_dataset(tokenizer, read_examples(path, fmt), max_seq_len)  # type: ignore[arg-type]
    except (FormatError, ChatTemplateError) as err:
        raise UserError(f"{Path(path).name}: {err}", code="invalid_dataset") from err
    except UnicodeDecodeError as err:
        raise UserError(f"{Path(path).name}: not UTF-8 ({err})", code="invalid_dataset") from err
    if not dataset.examples:
        raise UserError(
            f"{Path(path).name}: no example has a trained token left within max_seq_len={max_seq_len}",
            code="invalid_dataset",
        )
    return dataset


@dataclass
class JobData:
    train: TrainingData
    validation: TrainingData | None

    def stats(self) -> dict[str, int]:
        """Counts for the job's events: examples, tokens, truncated/dropped examples."""
        ds = self.train.dataset
        return {
            "train_examples": len(ds.examples),
            "train_tokens": ds.n_tokens,
            "truncated_examples": ds.n_truncated,
            "dropped_examples": ds.n_dropped,
            "rows_per_epoch": self.train.rows_per_epoch(0),
        }


def load_job_data(spec: Any, tokenizer: Any, *, pad_to: int | None = None) -> JobData:
    """Tokenize the spec's train (and validation) files into resumable TrainingData."""
    d = spec.data
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = TrainingData(
        tokenize_file(d.train_file, d.format, tokenizer, d.max_seq_len),
        max_seq_len=d.max_seq_len,
        micro_batch_size=spec.hyperparameters.micro_batch_size,
        seed=spec.seed,
        shuffle=d.shuffle,
        packing=d.packing,
        pad_id=pad_id,
        pad_to=pad_to,
    )
    validation = None
    if d.validation_file:
        validation = TrainingData(
            tokenize_file(d.validation_file, d.format, tokenizer, d.max_seq_len),
            max_seq_len=d.max_seq_len,
            micro_batch_size=spec.hyperparameters.micro_batch_size,
            seed=spec.seed,
            shuffle=False,  # the same batches at every evaluation
            packing=False,
            pad_id=pad_id,
            pad_to=pad_to,
        )
    return JobData(train=train, validation=validation)


def total_optimizer_steps(spec: Any, train: TrainingData, data_parallel: int = 1) -> int:
    """``max_steps`` if set, else ``n_epochs`` x optimizer steps per epoch (epoch 0's rows;
    with packing later epochs can differ by a row, which the cursor absorbs)."""
    hp = spec.hyperparameters
    if hp.max_steps is not None:
        return hp.max_steps
    micro_per_step = hp.batch_size // hp.micro_batch_size
    per_epoch = -(-train.micro_batches_per_epoch(0) // micro_per_step)
    return max(1, hp.n_epochs * per_epoch)
