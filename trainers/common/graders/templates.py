"""Grader templates: ``{{ item.reference_answer }}``, ``{{ sample.output_json.name }}``.

OpenAI's rules: any ``{{ ... }}`` in a grader's text is replaced by a value; inside, a
namespace (``item``: the data row; ``sample``: the model's completion) and a variable,
then any JSON-path-like steps (``.key``, ``[0]``, ``["key with spaces"]``). The sample's
variables are ``output_text``, ``output_json``, ``output_tools``, ``choices`` and
``output_audio`` (``samples.sample_namespace``).

A string value is inserted as it is; any other value as JSON. :func:`check` refuses a
template that can never resolve (validation); :func:`render` raises
:class:`MissingVariable` for a path the data lacks, or :class:`SampleNotJSON` for
``sample.output_json`` of a completion that is not JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

NAMESPACES = ("item", "sample")
SAMPLE_VARIABLES = ("output_text", "output_json", "output_tools", "choices", "output_audio")

_TEMPLATE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_STEP = re.compile(r"""\s*(?:\.([A-Za-z_][\w\-]*)|\[\s*(\d+)\s*\]|\[\s*"((?:[^"\\]|\\.)*)"\s*\]"""
                   r"""|\[\s*'((?:[^'\\]|\\.)*)'\s*\])""")
_HEAD = re.compile(r"\s*([A-Za-z_]\w*)")


class TemplateError(ValueError):
    """A template that can never resolve (an unknown namespace or sample variable, bad syntax)."""


class MissingVariable(LookupError):
    """The data has nothing at a template's path."""


class SampleNotJSON(LookupError):
    """A template reads ``sample.output_json`` but the completion is not JSON."""


def parse_path(expression: str) -> tuple[str, list[str | int]]:
    """``" item.a[0]['b c'] "`` -> ``("item", ["a", 0, "b c"])``; ``TemplateError`` if malformed."""
    head = _HEAD.match(expression)
    if head is None:
        raise TemplateError(f"'{{{{{expression}}}}}' must name a namespace and a variable, e.g. {{{{item.answer}}}}")
    namespace, position, steps = head.group(1), head.end(), []
    while position < len(expression.rstrip()):
        step = _STEP.match(expression, position)
        if step is None:
            raise TemplateError(f"'{{{{{expression}}}}}' is not a path like namespace.variable[0].key")
        key, index, double, single = step.groups()
        steps.append(int(index) if index is not None else key if key is not None else (double or single or ""))
        position = step.end()
    if namespace not in NAMESPACES:
        raise TemplateError(f"'{{{{{expression.strip()}}}}}' names the namespace '{namespace}'; "
                            "only 'item' and 'sample' exist")
    if not steps:
        raise TemplateError(f"'{{{{{expression.strip()}}}}}' must name a variable of '{namespace}', "
                            f"e.g. {{{{{namespace}.{'answer' if namespace == 'item' else 'output_text'}}}}}")
    if namespace == "sample" and steps[0] not in SAMPLE_VARIABLES:
        raise TemplateError(f"'{{{{{expression.strip()}}}}}': the sample has no variable '{steps[0]}' "
                            f"(it has {', '.join(SAMPLE_VARIABLES)})")
    return namespace, steps


def check(text: str) -> None:
    """Raise ``TemplateError`` for the first template of ``text`` that can never resolve."""
    if text.count("{{") != len(_TEMPLATE.findall(text)):
        raise TemplateError("a '{{' is not closed by '}}'")
    for match in _TEMPLATE.finditer(text):
        parse_path(match.group(1))


def expressions(text: str) -> list[str]:
    """The expressions inside ``text``'s templates (``"item.a"`` for ``{{ item.a }}``), in order."""
    return [match.group(1) for match in _TEMPLATE.finditer(text)]


def lookup(expression: str, item: Any, sample: dict[str, Any]) -> Any:
    """The value a template names (see the module doc for the errors)."""
    namespace, steps = parse_path(expression)
    value: Any = item if namespace == "item" else sample
    if namespace == "sample" and steps[0] == "output_json" and sample.get("output_json") is None:
        raise SampleNotJSON("the model's output is not valid JSON, so sample.output_json is empty")
    for step in steps:
        if (isinstance(step, int) and isinstance(value, list) and step < len(value)
                or isinstance(step, str) and isinstance(value, dict) and step in value):
            value = value[step]
        else:
            raise MissingVariable(f"{{{{{expression.strip()}}}}} names nothing in the {namespace}")
    return value


def render(text: str, item: Any, sample: dict[str, Any]) -> str:
    """``text`` with each template replaced by its value (strings as they are, the rest as JSON)."""
    def replace(match: re.Match[str]) -> str:
        value = lookup(match.group(1), item, sample)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return _TEMPLATE.sub(replace, text)
