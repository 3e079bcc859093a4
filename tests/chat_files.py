"""Generated training files in the OpenAI chat shapes beyond plain text, and ShareGPT.

Each builder returns JSONL bytes of ``n`` valid lines: assistant tool calls answered by
tool messages (with ``tools``), ``content`` given as text parts, and ShareGPT
``conversations``. ``BAD_TOOL_LINES`` holds one valid line then the invalid variants the
validator must name with their line and code.
"""

from __future__ import annotations

import json

CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Accra", "Perth")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Temperature in C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def tool_calling_row(i: int) -> dict:
    city, temp = CITIES[i % len(CITIES)], 10 + i % 17
    call_id = f"call_{i}"
    return {
        "messages": [
            {"role": "system", "content": "Use the tool."},
            {"role": "user", "content": f"How warm is it in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"c": temp})},
            {"role": "assistant", "content": f"It is {temp} C in {city}."},
        ],
        "tools": [WEATHER_TOOL],
        "parallel_tool_calls": False,
    }


def tool_calling_lines(n: int) -> bytes:
    return _jsonl([tool_calling_row(i) for i in range(n)])


def content_parts_lines(n: int) -> bytes:
    return _jsonl([{"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": f"{i} plus {i}?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": str(2 * i)}]},
    ]} for i in range(n)])


def sharegpt_lines(n: int) -> bytes:
    return _jsonl([{"id": f"conv-{i}", "conversations": [
        {"from": "system", "value": "You answer briefly."},
        {"from": "human", "value": f"What is {i} times 2?"},
        {"from": "gpt", "value": str(2 * i)},
    ]} for i in range(n)])


def _with_call(arguments: str) -> dict:
    row = tool_calling_row(1)
    row["messages"][2]["tool_calls"][0]["function"]["arguments"] = arguments
    return row


def _with_message_key() -> dict:
    row = tool_calling_row(2)
    row["messages"][1]["foo"] = 1
    return row


BAD_TOOL_LINES = _jsonl([tool_calling_row(0), _with_call('{"city": "Lima"'), _with_message_key()])
"""Line 2: arguments that are not JSON (invalid_arguments); line 3: an unknown message
key (unrecognized_key)."""
