"""`tunefleet chat MODEL PROMPT`: one chat completion (``POST /v1/chat/completions``) of a base
model, a fine-tuned model or one of its checkpoints.

The answer's text goes to stdout as it is (no table, no markup), so it pipes like any
text; ``--stream`` writes each token as it arrives. With ``--json`` the completion object is
printed, or, streaming, one ``chat.completion.chunk`` per line.
"""

# No `from __future__ import annotations`: typer reads the options' annotations at runtime.

import sys
from typing import Annotated

import typer

from tunefleet.cli.options import client_command
from tunefleet.cli.render import print_json, print_json_line
from tunefleet.sdk.client import Tunefleet


def _prompt_text(prompt: str) -> str:
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    if not text.strip():
        raise typer.BadParameter("stdin held no prompt", param_hint="PROMPT")
    return text


@client_command
def chat(
    client: Tunefleet,
    json_out: bool,
    model: Annotated[str, typer.Argument(help="A base model, fine-tuned model or checkpoint id.")],
    prompt: Annotated[str, typer.Argument(help="The user message; '-' reads it from stdin.")],
    system: Annotated[str | None, typer.Option(help="A system message sent before the prompt.")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        min=1, help="Longest answer in tokens (default: the service's, fitted to the model's context).")] = None,
    temperature: Annotated[float, typer.Option(
        min=0.0, max=2.0, help="Sampling temperature; 0 (the default) answers greedily, the same each time.")
    ] = 0.0,
    stream: Annotated[bool, typer.Option("--stream", help="Print the answer token by token as it comes.")] = False,
) -> None:
    """Ask a model one question and print its answer."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": _prompt_text(prompt)})
    params = {"temperature": temperature}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if not stream:
        completion = client.chat.completions.create(model=model, messages=messages, **params)
        if json_out:
            print_json(completion)
        else:
            sys.stdout.write((completion["choices"][0]["message"].get("content") or "") + "\n")
        return
    for chunk in client.chat.completions.stream(model=model, messages=messages, **params):
        if json_out:
            print_json_line(chunk)
            continue
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
    if not json_out:
        sys.stdout.write("\n")
