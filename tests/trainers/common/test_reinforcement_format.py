"""The reinforcement fine-tuning file format: prompts ending in a user turn, plus the keys
a grader reads as ``{{item.<key>}}``; detected, validated and read by the shared module."""

from __future__ import annotations

import json

import pytest

from trainers.common.formats import (
    PROBLEM_CODES,
    FormatError,
    Message,
    ReinforcementExample,
    read_examples,
    read_reinforcement_examples,
    validate_jsonl,
)


def jsonl(*objs: object) -> bytes:
    return b"\n".join(o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs) + b"\n"


PROMPT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "reference_answer": "4", "id": 7}
FEW_SHOT = {"messages": [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "1 + 1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "3 + 3?"},
], "reference_answer": "6"}
CHAT = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}


def test_prompts_with_item_keys_validate_as_reinforcement():
    report = validate_jsonl(jsonl(PROMPT, FEW_SHOT, {**PROMPT, "extra": [1]}))
    assert report.ok, report.errors
    assert (report.format, report.n_examples) == ("reinforcement", 3)
    # Only the keys every line has are ones a grader may read on any line.
    assert report.item_keys == ("messages", "reference_answer")
    assert report.to_dict()["item_keys"] == ["messages", "reference_answer"]
    assert report.n_tokens_estimate == -(-(len("What is 2 + 2?") * 2 + len("Answer with a number.1 + 1?23 + 3?")) // 4)


def test_read_back_with_the_item_and_prompt():
    first, second = read_reinforcement_examples([json.dumps(PROMPT), json.dumps(FEW_SHOT)])
    assert first == ReinforcementExample(prompt=(Message("user", "What is 2 + 2?"),), item=PROMPT)
    assert [m.role for m in second.prompt] == ["system", "user", "assistant", "user"]
    assert second.item["reference_answer"] == "6"


def test_tools_are_read_as_in_chat():
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    (example,) = read_reinforcement_examples([json.dumps({**PROMPT, "tools": [tool]})])
    assert example.tools == (tool,)


def test_a_multi_turn_first_line_needs_weight_zero_to_read_as_a_prompt():
    # A first line with a trained assistant turn is a chat line (chat files keep reading as
    # they always did); weight 0 on the few-shot turns makes it a prompt.
    assert validate_jsonl(jsonl(FEW_SHOT)).format == "chat"
    few_shot = json.loads(json.dumps(FEW_SHOT))
    few_shot["messages"][2]["weight"] = 0
    assert validate_jsonl(jsonl(few_shot, PROMPT)).format == "reinforcement"


@pytest.mark.parametrize(
    ("lines", "code", "line"),
    [
        ([PROMPT, CHAT], "prompt_not_user_last", 2),
        ([PROMPT, {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]}],
         "prompt_not_user_last", 2),
        ([PROMPT, {"prompt": "p", "completion": "c"}], "mixed_formats", 2),
        ([PROMPT, {"reference_answer": "4"}], "missing_messages", 2),
        ([PROMPT, {"messages": [{"role": "user", "content": " "}]}], "empty_content", 2),
        ([PROMPT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}],
         "unsupported_content_type", 2),
        ([PROMPT, {"messages": []}], "invalid_messages", 2),
        ([PROMPT, {"messages": [{"role": "user", "content": "a", "bogus": 1}]}], "unrecognized_key", 2),
        ([CHAT, PROMPT], "no_assistant_message", 2),
    ],
)
def test_problems_have_stable_codes_and_line_numbers(lines, code, line):
    report = validate_jsonl(jsonl(*lines), min_examples=0)
    assert not report.ok
    assert (report.errors[0].code, report.errors[0].line) == (code, line), report.errors
    assert code in PROBLEM_CODES


def test_other_formats_report_no_item_keys():
    report = validate_jsonl(jsonl(CHAT))
    assert report.item_keys is None and "item_keys" not in report.to_dict()


def test_readers_refuse_the_other_kind():
    with pytest.raises(ValueError, match="read_reinforcement_examples"):
        list(read_examples([json.dumps(PROMPT)]))
    with pytest.raises(FormatError) as caught:
        list(read_reinforcement_examples([json.dumps(PROMPT), json.dumps(CHAT)]))
    assert (caught.value.code, caught.value.line) == ("prompt_not_user_last", 2)
