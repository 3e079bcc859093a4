"""Extract the OpenAI object schemas the service answers with from OpenAI's published
OpenAPI document into ``objects.json`` (JSON Schema 2020-12, ``$defs``), for
``tests/api/test_openai_objects.py``.

Usage: ``python tests/api/openai_schemas/extract.py <openapi.json> <source commit>``, where
``openapi.json`` is the file of github.com/openai/openai-openapi (MIT) at that commit.

The document is OpenAPI 3.1 but still spells some rules the 3.0 way; they are rewritten
into what they mean so a JSON Schema validator reads them as OpenAI intends:
``nullable: true`` adds ``null`` to the types, and a boolean ``exclusiveMinimum`` /
``exclusiveMaximum`` turns its ``minimum`` / ``maximum`` into an exclusive bound.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOTS = (
    "OpenAIFile", "ListFilesResponse",
    "FineTuningJobEvent", "ListFineTuningJobEventsResponse",
    "FineTuningJobCheckpoint", "ListFineTuningJobCheckpointsResponse",
    "FineTuneSupervisedHyperparameters", "FineTuneDPOHyperparameters",
    "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
)
_REF = "#/components/schemas/"
_DROP = {"x-oaiMeta", "x-oaiTypeLabel", "x-stainless-const", "example", "examples", "description", "title",
         "deprecated"}


def _rewrite(node: Any, needed: set[str]) -> Any:
    """``node`` (a schema) without annotations, its references and 3.0 spellings rewritten."""
    if isinstance(node, list):
        return [_rewrite(item, needed) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite(v, needed) for k, v in node.items() if k not in _DROP and k != "properties"}
    if isinstance(node.get("properties"), dict):  # property names are data, never annotations
        out["properties"] = {name: _rewrite(v, needed) for name, v in node["properties"].items()}
    if isinstance(out.get("$ref"), str) and out["$ref"].startswith(_REF):
        needed.add(out["$ref"].removeprefix(_REF))
        out["$ref"] = "#/$defs/" + out["$ref"].removeprefix(_REF)
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(exclusive) is True:
            out[exclusive] = out.pop(bound)
        elif out.get(exclusive) is False:
            del out[exclusive]
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def extract(document: dict[str, Any]) -> dict[str, Any]:
    schemas = document["components"]["schemas"]
    defs: dict[str, Any] = {}
    pending = set(ROOTS)
    while pending:
        name = pending.pop()
        needed: set[str] = set()
        defs[name] = _rewrite(schemas[name], needed)
        pending |= needed - set(defs)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": dict(sorted(defs.items()))}


def main(source: str, commit: str) -> None:
    out = extract(json.loads(Path(source).read_text(encoding="utf-8")))
    out["$comment"] = f"Extracted from github.com/openai/openai-openapi openapi.json at {commit} (MIT)."
    target = Path(__file__).with_name("objects.json")
    target.write_text(json.dumps(out, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    print(f"{len(out['$defs'])} schemas -> {target}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
