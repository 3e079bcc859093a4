"""OpenAI chat files with tool calls, content parts, and ShareGPT files, through the
official ``openai`` SDK: they validate as the trainers read them, and an invalid variant
is answered with its line number and stable code (on the file and on job creation).
The real training runs of these files: ``tests/e2e/test_openai_chat_training.py``."""

from __future__ import annotations

import io

import openai
import pytest

from tests.chat_files import BAD_TOOL_LINES, content_parts_lines, sharegpt_lines, tool_calling_lines


@pytest.mark.parametrize(
    ("body", "fmt"),
    [(tool_calling_lines(6), "chat"), (content_parts_lines(6), "chat"), (sharegpt_lines(6), "sharegpt")],
    ids=["tool_calls", "content_parts", "sharegpt"],
)
def test_valid_files_are_processed_and_accepted_for_a_job(sdk, body: bytes, fmt: str) -> None:
    oai, _ = sdk
    uploaded = oai.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune")
    file = oai.files.retrieve(uploaded.id)
    assert file.status == "processed", file
    report = file.model_extra["validation"]
    assert (report["ok"], report["format"], report["n_examples"]) == (True, fmt, 6), report
    assert report["n_tokens_estimate"] > 0
    job = oai.fine_tuning.jobs.create(model="tunefleet-tiny-llama", training_file=uploaded.id)
    assert job.status == "queued" and job.training_file == uploaded.id


def test_invalid_tool_call_and_unknown_message_key_are_named_by_line_and_code(sdk) -> None:
    oai, _ = sdk
    uploaded = oai.files.create(file=("bad.jsonl", io.BytesIO(BAD_TOOL_LINES)), purpose="fine-tune")
    file = oai.files.retrieve(uploaded.id)
    assert file.status == "error"
    assert file.status_details.startswith("2 problem(s); first: line 2: invalid_arguments: "), file.status_details
    errors = file.model_extra["validation"]["errors"]
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_arguments"), (3, "unrecognized_key")]
    assert "messages[2].tool_calls[0].function.arguments is not valid JSON" in errors[0]["message"]
    assert "'foo'" in errors[1]["message"] and "messages[1]" in errors[1]["message"]

    with pytest.raises(openai.BadRequestError) as caught:
        oai.fine_tuning.jobs.create(model="tunefleet-tiny-llama", training_file=uploaded.id)
    assert caught.value.code == "invalid_file" and caught.value.param == "training_file"
    assert "line 2: invalid_arguments" in caught.value.message
    assert "line 3: unrecognized_key" in caught.value.message
