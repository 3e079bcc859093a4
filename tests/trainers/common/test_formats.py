"""Training-file formats: every stable code, canonical conversion, and reading."""

from __future__ import annotations

import json

import pytest

from trainers.common.formats import (
    PROBLEM_CODES,
    Example,
    FormatError,
    Message,
    PreferenceExample,
    ToolCall,
    detect_format,
    read_examples,
    read_preference_examples,
    validate_jsonl,
)


def jsonl(*objs: object) -> bytes:
    return b"\n".join(json.dumps(o).encode() if not isinstance(o, bytes) else o for o in objs)


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PC = {"prompt": "2+2=", "completion": "4"}
ALPACA = {"instruction": "Add", "input": "2 and 2", "output": "4"}


@pytest.mark.parametrize(
    ("obj", "fmt", "expected"),
    [
        (CHAT, "chat", (Message("user", "hi"), Message("assistant", "hello"))),
        (PC, "prompt_completion", (Message("user", "2+2="), Message("assistant", "4"))),
        (ALPACA, "alpaca", (Message("user", "Add\n\n2 and 2"), Message("assistant", "4"))),
        ({"instruction": "Say hi", "output": "hi"}, "alpaca", (Message("user", "Say hi"), Message("assistant", "hi"))),
        ({"instruction": "Say hi", "input": "", "output": "hi"}, "alpaca",
         (Message("user", "Say hi"), Message("assistant", "hi"))),
        ({"prompt": "", "completion": "x"}, "prompt_completion", (Message("assistant", "x"),)),
    ],
)
def test_valid_formats_become_canonical_examples(obj, fmt, expected):
    report = validate_jsonl(jsonl(obj, obj))
    assert report.ok, report.errors
    assert report.format == fmt
    assert report.n_examples == 2
    assert list(read_examples([json.dumps(obj)], fmt)) == [Example(expected)]


def test_weights_and_system_turns_are_kept():
    obj = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "weight": 0},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d", "weight": 1},
        ]
    }
    (ex,) = read_examples([json.dumps(obj)])
    assert [m.weight for m in ex.messages] == [1, 1, 0, 1, 1]
    assert ex.messages[0] == Message("system", "be brief")


@pytest.mark.parametrize(
    ("lines", "code", "line"),
    [
        ([b"\xff\xfe{}"], "not_utf8", 1),
        ([CHAT, b"{not json"], "invalid_json", 2),
        ([b"[1, 2]"], "not_an_object", 1),
        ([{"text": "raw"}], "unknown_format", 1),
        ([CHAT, PC], "mixed_formats", 2),
        ([CHAT, {"foo": 1}], "missing_messages", 2),
        ([{"messages": []}], "invalid_messages", 1),
        ([{"messages": ["hi"]}], "invalid_messages", 1),
        ([{"messages": [{"content": "x"}]}], "invalid_messages", 1),
        ([{"messages": [{"role": "robot", "content": "x"}]}], "unrecognized_role", 1),
        ([{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}], "missing_content", 1),
        ([{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}],
         "empty_content", 1),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "weight": 2}]}],
         "invalid_weight", 1),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "weight": True}]}],
         "invalid_weight", 1),
        ([{"messages": [{"role": "user", "content": "a", "weight": 1}, {"role": "assistant", "content": "x"}]}],
         "invalid_weight", 1),
        # A prompt alone is a reinforcement file's line; in a chat file it has nothing to train on.
        ([CHAT, {"messages": [{"role": "user", "content": "a"}]}], "no_assistant_message", 2),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "weight": 0}]}],
         "no_assistant_message", 1),
        ([PC, {"prompt": "only"}], "missing_field", 2),
        ([ALPACA, {"instruction": "only"}], "missing_field", 2),
        ([PC, {"foo": "bar"}], "missing_field", 2),
        ([{"prompt": 3, "completion": "x"}], "invalid_type", 1),
        ([{"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "x"}]}],
         "invalid_type", 1),
        ([{"instruction": "a", "input": 5, "output": "b"}], "invalid_type", 1),
        ([{"prompt": "p", "completion": ""}], "empty_content", 1),
    ],
)
def test_each_problem_has_its_stable_code_and_line(lines, code, line):
    report = validate_jsonl(jsonl(*lines), min_examples=0)
    assert not report.ok
    assert (report.errors[0].code, report.errors[0].line) == (code, line)
    assert code in PROBLEM_CODES


def test_line_too_long(monkeypatch):
    from trainers.common import formats

    monkeypatch.setattr(formats, "MAX_LINE_BYTES", 100)
    long = {"prompt": "x" * 200, "completion": "y"}
    report = validate_jsonl(jsonl(PC, long))
    assert [(e.line, e.code) for e in report.errors] == [(2, "line_too_long")]


def test_empty_file_and_too_few_examples():
    assert [e.code for e in validate_jsonl(b"").errors] == ["empty_file"]
    assert [e.code for e in validate_jsonl(b"\n  \n\n").errors] == ["empty_file"]
    report = validate_jsonl(jsonl(PC), min_examples=2)
    assert [(e.line, e.code) for e in report.errors] == [(None, "too_few_examples")]
    # a file of only bad lines also has too few examples
    report = validate_jsonl(b"{bad\n")
    assert [e.code for e in report.errors] == ["invalid_json", "too_few_examples"]


def test_blank_lines_bom_and_crlf_keep_1_based_line_numbers():
    data = b"\xef\xbb\xbf" + json.dumps(PC).encode() + b"\r\n\r\n" + b"{oops\r\n" + json.dumps(PC).encode()
    report = validate_jsonl(data)
    assert report.n_examples == 2
    assert [(e.line, e.code) for e in report.errors] == [(3, "invalid_json")]


def test_errors_are_bounded_but_all_counted():
    report = validate_jsonl(b"\n".join([b"{bad"] * 120), max_errors=5)
    assert len(report.errors) == 5
    assert report.n_errors == 121  # 120 bad lines + too_few_examples
    d = report.to_dict()
    assert d["ok"] is False and d["n_errors"] == 121 and len(d["errors"]) == 5


def test_first_valid_line_fixes_the_format():
    # a broken first line must not decide the format
    report = validate_jsonl(jsonl({"text": 1}, PC, PC))
    assert report.format == "prompt_completion"
    assert [(e.line, e.code) for e in report.errors] == [(1, "unknown_format")]


def test_token_estimate_is_chars_over_4():
    obj = {"prompt": "a" * 10, "completion": "b" * 7}  # 17 chars -> ceil(17/4) = 5
    assert validate_jsonl(jsonl(obj)).n_tokens_estimate == 5
    assert validate_jsonl(jsonl(obj, obj)).n_tokens_estimate == 9


def test_detect_format():
    assert detect_format(CHAT) == "chat"
    assert detect_format(PC) == "prompt_completion"
    assert detect_format(ALPACA) == "alpaca"
    assert detect_format({"x": 1}) is None
    assert detect_format([1]) is None


def test_read_examples_from_path_raises_with_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl(PC, PC) + b"\n\n" + jsonl({"prompt": "p", "completion": 1}))
    it = read_examples(path)
    assert len([next(it), next(it)]) == 2
    with pytest.raises(FormatError) as err:
        next(it)
    assert (err.value.code, err.value.line) == ("invalid_type", 4)


def test_read_examples_rejects_unknown_format_name():
    with pytest.raises(ValueError):
        list(read_examples([json.dumps(PC)], "csv"))  # type: ignore[arg-type]


# --- preference (DPO) lines: OpenAI's input / preferred_output / non_preferred_output ---

PREF = {
    "input": {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2?"}]},
    "preferred_output": [{"role": "assistant", "content": "4"}],
    "non_preferred_output": [{"role": "assistant", "content": "5"}],
}


def test_preference_line_becomes_a_preference_example():
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    with_tools = {**PREF, "input": {**PREF["input"], "tools": tools, "parallel_tool_calls": False}}
    report = validate_jsonl(jsonl(PREF, with_tools))
    assert report.ok, report.errors
    assert (report.format, report.n_examples) == ("preference", 2)
    # chars: "add" + "2+2?" + "4" + "5" = 9 per line, plus the tools' JSON once on line 2
    assert report.n_tokens_estimate == -(-(9 + 9 + len(json.dumps(tools))) // 4)
    first, second = read_preference_examples([json.dumps(PREF), json.dumps(with_tools)])
    assert first == PreferenceExample(
        prompt=(Message("system", "add"), Message("user", "2+2?")),
        chosen=Message("assistant", "4"),
        rejected=Message("assistant", "5"),
    )
    assert second.tools == tuple(tools)


def test_preference_answers_may_call_tools_and_answer_prompt_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"a": 2}'}}
    obj = {
        "input": {"messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"},
        ]},
        "preferred_output": [{"role": "assistant", "content": "It is 4."}],
        "non_preferred_output": [{"role": "assistant", "content": None, "tool_calls": [call]}],
    }
    (ex,) = read_preference_examples([json.dumps(obj)])
    assert ex.prompt[2] == Message("tool", "4", tool_call_id="c1")
    assert ex.rejected == Message("assistant", "", tool_calls=(ToolCall("c1", "calc", '{"a": 2}'),))


def _pref(**changes):
    return {**PREF, **changes}


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        ({k: v for k, v in PREF.items() if k != "input"}, "missing_field"),
        (_pref(input=[1]), "invalid_type"),
        (_pref(input={"tools": []}), "missing_messages"),
        (_pref(input={"messages": []}), "invalid_messages"),
        (_pref(input={"messages": [{"role": "user", "content": "x", "foo": 1}]}), "unrecognized_key"),
        ({k: v for k, v in PREF.items() if k != "preferred_output"}, "missing_field"),
        (_pref(preferred_output=[]), "invalid_preference_output"),
        (_pref(preferred_output={"role": "assistant", "content": "4"}), "invalid_preference_output"),
        (_pref(non_preferred_output=[{"role": "assistant", "content": "4"}] * 2), "invalid_preference_output"),
        (_pref(non_preferred_output=[{"role": "user", "content": "4"}]), "invalid_preference_output"),
        (_pref(non_preferred_output=[{"role": "assistant", "content": " "}]), "empty_content"),
        (_pref(non_preferred_output=[{"role": "assistant", "content": "4", "weight": 0}]), "invalid_weight"),
        (_pref(input={**PREF["input"], "tools": [{"type": "function", "function": {}}]}), "invalid_tools"),
    ],
)
def test_preference_problems_have_stable_codes_and_lines(obj, code):
    report = validate_jsonl(jsonl(PREF, obj), min_examples=0)
    assert [(e.line, e.code) for e in report.errors] == [(2, code)], report.errors
    assert code in PROBLEM_CODES


def test_preference_and_supervised_files_do_not_mix_and_readers_are_typed():
    assert [(e.line, e.code) for e in validate_jsonl(jsonl(PREF, CHAT)).errors] == [(2, "mixed_formats")]
    assert [(e.line, e.code) for e in validate_jsonl(jsonl(CHAT, PREF)).errors] == [(2, "mixed_formats")]
    assert detect_format(PREF) == "preference"
    with pytest.raises(ValueError, match="read_preference_examples"):
        list(read_examples([json.dumps(PREF)]))
    with pytest.raises(ValueError):
        list(read_examples([json.dumps(PREF)], "preference"))
    with pytest.raises(FormatError) as err:
        list(read_preference_examples([json.dumps(PREF), json.dumps(CHAT)]))
    assert (err.value.code, err.value.line) == ("mixed_formats", 2)


# --- OpenAI chat lines with tools, content parts, names and legacy functions ---

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_CHAT = {
    "messages": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 degrees.", "weight": 1},
    ],
    "tools": [WEATHER_TOOL],
    "parallel_tool_calls": False,
}


def test_tool_calling_line_becomes_canonical_example():
    report = validate_jsonl(jsonl(TOOL_CHAT))
    assert report.ok, report.errors
    (ex,) = read_examples([json.dumps(TOOL_CHAT)])
    assert ex == Example(
        messages=(
            Message("system", "You help."),
            Message("user", "Weather in Paris?", name="ann"),
            Message("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
            Message("tool", '{"temp": 21}', tool_call_id="call_1"),
            Message("assistant", "21 degrees."),
        ),
        tools=(WEATHER_TOOL,),
        parallel_tool_calls=False,
    )
    chars = len("You help.Weather in Paris?get_weather") + len('{"city": "Paris"}{"temp": 21}21 degrees.')
    assert report.n_tokens_estimate == -(-(chars + len(json.dumps([WEATHER_TOOL]))) // 4)


def test_content_parts_are_concatenated_and_calls_may_come_with_content():
    obj = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {"function": {"name": "a", "arguments": "{}"}}, {"function": {"name": "b", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": ""},  # an empty tool result is a result
        {"role": "assistant", "content": "done"},
    ]}
    (ex,) = read_examples([json.dumps(obj)])
    assert ex.messages[0].content == "Hello, world"
    # ids given without one are generated, distinct within the line
    assert ex.messages[1] == Message(
        "assistant", "Checking.", tool_calls=(ToolCall("call_1", "a", "{}"), ToolCall("call_2", "b", "{}")))
    assert ex.messages[2] == Message("tool", "", tool_call_id="call_2")


def test_legacy_functions_and_function_call():
    obj = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None,
             "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"role": "function", "name": "get_weather", "content": "21"},
            {"role": "assistant", "content": "21 degrees."},
        ],
        "functions": [WEATHER_TOOL["function"]],
    }
    (ex,) = read_examples([json.dumps(obj)])
    assert ex.tools == (WEATHER_TOOL,)
    (call,) = ex.messages[1].tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert ex.messages[2] == Message("tool", "21", name="get_weather", tool_call_id=call.id)


def _chat(*messages, **top):
    return {"messages": [{"role": "user", "content": "q"}, *messages, {"role": "assistant", "content": "a"}], **top}


def _call(**function):
    return {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": function}]}


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        ({"messages": [{"role": "user", "content": "x", "foo": 1}, {"role": "assistant", "content": "y"}]},
         "unrecognized_key"),
        (_chat({"role": "assistant", "content": "y", "metadata": {}}), "unrecognized_key"),
        (_chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}),
         "unsupported_content_type"),
        (_chat({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}), "unsupported_content_type"),
        (_chat({"role": "user", "content": [{"text": "no type"}]}), "invalid_type"),
        (_chat({"role": "user", "content": [{"type": "text", "text": 3}]}), "invalid_type"),
        (_chat({"role": "user", "content": []}), "empty_content"),
        (_chat({"role": "user", "content": "x", "name": 5}), "invalid_type"),
        (_chat({"role": "assistant"}), "missing_content"),
        (_chat({"role": "assistant", "tool_calls": []}), "invalid_tool_call"),
        (_chat({"role": "assistant", "tool_calls": {"id": "c"}}), "invalid_tool_call"),
        (_chat({"role": "assistant", "tool_calls": ["c"]}), "invalid_tool_call"),
        (_chat({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]}),
         "invalid_tool_call"),
        (_chat({"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f", "arguments": "{}"}}]}),
         "invalid_tool_call"),
        (_chat({"role": "user", "content": "x", "tool_calls": [CALL]}), "invalid_tool_call"),
        (_chat({"role": "user", "content": "x", "tool_call_id": "c"}), "invalid_tool_call"),
        (_chat({**_call(name="f", arguments="{}"), "function_call": {"name": "f", "arguments": "{}"}}),
         "invalid_tool_call"),
        (_chat({"role": "assistant", "function_call": "f"}), "invalid_tool_call"),
        (_chat({"role": "assistant", "tool_calls": [{"id": "c"}]}), "missing_function_name"),
        (_chat(_call(arguments="{}")), "missing_function_name"),
        (_chat(_call(name=" ", arguments="{}")), "missing_function_name"),
        (_chat({"role": "assistant", "function_call": {"arguments": "{}"}}), "missing_function_name"),
        (_chat(_call(name="f", arguments='{"city": "Paris"')), "invalid_arguments"),
        (_chat(_call(name="f", arguments={"city": "Paris"})), "invalid_arguments"),
        (_chat(_call(name="f", arguments="[1]")), "invalid_arguments"),
        (_chat(_call(name="f")), "invalid_arguments"),
        (_chat(_call(name="f", arguments="{}"), {"role": "tool", "content": "r"}), "unknown_tool_call_id"),
        (_chat(_call(name="f", arguments="{}"), {"role": "tool", "tool_call_id": "other", "content": "r"}),
         "unknown_tool_call_id"),
        (_chat({"role": "tool", "tool_call_id": "c", "content": "r"}, _call(name="f", arguments="{}")),
         "unknown_tool_call_id"),
        (_chat({"role": "function", "name": "f", "content": "r"}), "unknown_tool_call_id"),
        (_chat(_call(name="f", arguments="{}"), {"role": "tool", "tool_call_id": "c"}), "missing_content"),
        (_chat(tools={"type": "function"}), "invalid_tools"),
        (_chat(tools=[{"type": "function", "function": {"description": "no name"}}]), "invalid_tools"),
        (_chat(tools=[{"type": "retrieval"}]), "invalid_tools"),
        (_chat(tools=[WEATHER_TOOL], functions=[WEATHER_TOOL["function"]]), "invalid_tools"),
        (_chat(functions=[{"name": "f", "parameters": "x"}]), "invalid_tools"),
        (_chat(parallel_tool_calls="yes"), "invalid_type"),
    ],
)
def test_chat_tool_and_content_problems(obj, code):
    report = validate_jsonl(jsonl(TOOL_CHAT, obj), min_examples=0)
    assert [(e.line, e.code) for e in report.errors] == [(2, code)], report.errors
    assert code in PROBLEM_CODES


def test_unrecognized_key_message_names_the_key_and_the_known_set():
    report = validate_jsonl(jsonl(_chat({"role": "user", "content": "x", "foo": 1})), min_examples=0)
    (problem,) = report.errors
    assert "'foo'" in problem.message and "tool_call_id" in problem.message and "messages[1]" in problem.message


def test_every_problem_code_is_documented():
    from trainers.common import formats

    for code in PROBLEM_CODES:
        assert f"\n{code} " in formats.__doc__, code


# --- ShareGPT ---

SHAREGPT = {"id": "x1", "conversations": [
    {"from": "system", "value": "be brief"},
    {"from": "human", "value": "hi"},
    {"from": "gpt", "value": "hello"},
    {"from": "user", "value": "again"},
    {"from": "assistant", "value": "hello again"},
]}


def test_sharegpt_maps_to_messages():
    report = validate_jsonl(jsonl(SHAREGPT, SHAREGPT))
    assert (report.ok, report.format, report.n_examples) == (True, "sharegpt", 2)
    (ex,) = read_examples([json.dumps(SHAREGPT)], "sharegpt")
    assert ex == Example((
        Message("system", "be brief"), Message("user", "hi"), Message("assistant", "hello"),
        Message("user", "again"), Message("assistant", "hello again"),
    ))


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        (CHAT, "mixed_formats"),
        ({"conversations": []}, "invalid_messages"),
        ({"conversations": ["hi"]}, "invalid_messages"),
        ({"conversations": [{"value": "hi"}]}, "invalid_messages"),
        ({"conversations": [{"from": "bot", "value": "hi"}]}, "unrecognized_role"),
        ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}, "missing_content"),
        ({"conversations": [{"from": "human", "value": 1}, {"from": "gpt", "value": "x"}]}, "invalid_type"),
        ({"conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "x"}]}, "empty_content"),
        ({"conversations": [{"from": "human", "value": "x"}]}, "no_assistant_message"),
    ],
)
def test_sharegpt_problems(obj, code):
    report = validate_jsonl(jsonl(SHAREGPT, obj), min_examples=0)
    assert [(e.line, e.code) for e in report.errors] == [(2, code)], report.errors


def test_lines_read_in_chunks_are_the_lines_of_the_whole_file() -> None:
    from trainers.common.formats import split_lines

    data = b"\xef\xbb\xbf" + b'{"a": 1}\r\n\n' + b"x" * 50 + b"\nlast"
    expected = [(n, raw.rstrip(b"\r"), len(raw.rstrip(b"\r")))
                for n, raw in enumerate(data[3:].split(b"\n"), start=1)]
    for size in (1, 3, 7, len(data)):
        chunks = [data[i:i + size] for i in range(0, len(data), size)]
        assert list(split_lines(chunks)) == expected, size


def test_a_line_over_the_limit_is_refused_without_being_held_whole(monkeypatch) -> None:
    from trainers.common import formats

    monkeypatch.setattr(formats, "MAX_LINE_BYTES", 16)
    lines = list(formats.split_lines([b"y" * 10] * 10 + [b"\n{}"]))
    assert [(n, len(raw), length) for n, raw, length in lines] == [(1, 17, 100), (2, 2, 2)]
    report = formats.validate_jsonl([b"y" * 10] * 10 + [b"\n{}"])
    assert report.errors[0].to_dict() == {"line": 1, "code": "line_too_long",
                                          "message": "line is 100 bytes, the limit is 16"}


def test_token_stats_bound_the_tokens_a_byte_level_tokenizer_renders(tiny_tokenizer):
    """The validator's byte bound is at least what the chat template and a byte-level
    tokenizer make of each row (the tiny model's: one token per byte, the worst case)."""
    from trainers.common.data import tokenize_example, tokenize_preference
    from trainers.common.formats import read_examples, read_preference_examples, validate_jsonl

    chat = [
        {"messages": [{"role": "user", "content": "héllo wörld ✓ " * 20}, {"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                      {"role": "assistant", "content": "6 " * 300}]},
        {"messages": [{"role": "user", "content": "weather?"},
                      {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                          "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                      {"role": "assistant", "content": "Sunny."}],
         "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
    ]
    data = "\n".join(json.dumps(r, ensure_ascii=False) for r in chat)
    stats = validate_jsonl(data.encode()).token_stats
    real = [len(tokenize_example(tiny_tokenizer, ex).input_ids) for ex in read_examples(data.splitlines())]
    assert stats.rows == 3 and stats.longest_row >= max(real) and stats.total_tokens >= sum(real)
    assert stats.longest_row_line == 2 and real.index(max(real)) == 1

    pref = {"input": {"messages": [{"role": "user", "content": "pick ✓"}]},
            "preferred_output": [{"role": "assistant", "content": "yes " * 50}],
            "non_preferred_output": [{"role": "assistant", "content": "no"}]}
    line = json.dumps(pref, ensure_ascii=False)
    pstats = validate_jsonl(line.encode()).token_stats
    chosen, rejected = tokenize_preference(tiny_tokenizer, next(read_preference_examples([line])), max_seq_len=10_000)
    assert pstats.longest_row >= max(len(chosen.input_ids), len(rejected.input_ids))
