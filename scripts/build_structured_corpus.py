"""Build ``decodekit/data/structured/schemas.jsonl``, the corpus of ``decodekit eval structured``.

Two sources, one JSON object a line (``id``, ``source``, ``prompt``, ``schema``):
* schemas adapted from the official JSON-Schema-Test-Suite (draft 2020-12, MIT; its licence is
  ``structured/LICENSE``): up to three a file, among those llguidance compiles and Python's jsonschema can check, each given a prompt
  that asks for a JSON value satisfying it. These are adapted schemas, not the Test Suite itself
  (the suite's tests are not included, only schemas from them, with prompts written here);
* application schemas written here (nested objects, bounded arrays, enums, patterns, numeric
  ranges, ``$ref``), each with a natural-language request.

    .venv/bin/python scripts/build_structured_corpus.py ../shared/data/json-schema-test-suite/draft2020-12
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
from llguidance import LLMatcher

OUT = Path(__file__).resolve().parents[1] / "src/decodekit/data/structured/schemas.jsonl"
PER_FILE = 3

APPLICATION = [
    ("person", "Describe Ann, a 31-year-old painter from Lisbon, as JSON.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                       "city": {"type": "string", "maxLength": 40}, "job": {"type": "string", "maxLength": 40}},
      "required": ["name", "age", "city"], "additionalProperties": False}),
    ("order", "Write the JSON for an order of 2 coffees and 1 croissant, paid by card.",
     {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
         "type": "object", "properties": {"product": {"type": "string", "maxLength": 30}, "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
         "required": ["product", "quantity"], "additionalProperties": False}},
                                       "payment": {"enum": ["card", "cash", "voucher"]}},
      "required": ["items", "payment"], "additionalProperties": False}),
    ("event", "Give a JSON calendar event: a team meeting on 2024-05-14 from 10:00 to 11:00 in room B.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                       "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                       "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                       "end": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                       "room": {"type": "string", "maxLength": 20}},
      "required": ["title", "date", "start", "end"], "additionalProperties": False}),
    ("sentiment", "Classify the sentiment of 'The film was a delight from start to finish.' as JSON.",
     {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["label", "confidence"], "additionalProperties": False}),
    ("address", "Return the address 221B Baker Street, London NW1 6XE, UK as JSON.",
     {"$defs": {"line": {"type": "string", "maxLength": 50}},
      "type": "object", "properties": {"street": {"$ref": "#/$defs/line"}, "city": {"$ref": "#/$defs/line"},
                                       "postcode": {"type": "string", "maxLength": 10}, "country": {"type": "string", "minLength": 2, "maxLength": 2}},
      "required": ["street", "city", "country"], "additionalProperties": False}),
    ("recipe", "Give a short pancake recipe as JSON with at most 5 ingredients.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                       "ingredients": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 30}},
                                       "minutes": {"type": "integer", "minimum": 1, "maximum": 240}},
      "required": ["title", "ingredients", "minutes"], "additionalProperties": False}),
    ("ticket", "File a bug ticket as JSON: the login button does nothing on mobile; it is urgent.",
     {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 80},
                                       "severity": {"enum": ["low", "medium", "high", "critical"]},
                                       "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 15}}},
      "required": ["summary", "severity"], "additionalProperties": False}),
    ("weather", "Report today's weather in Oslo as JSON: 3 degrees Celsius and light snow.",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "celsius": {"type": "number", "minimum": -90, "maximum": 60},
                                       "conditions": {"enum": ["clear", "cloudy", "rain", "snow", "storm"]}},
      "required": ["city", "celsius", "conditions"], "additionalProperties": False}),
    ("answer", "What is 17 times 3? Answer in JSON with the number and one sentence of reasoning.",
     {"type": "object", "properties": {"answer": {"type": "integer"}, "reasoning": {"type": "string", "maxLength": 100}},
      "required": ["answer", "reasoning"], "additionalProperties": False}),
    ("contacts", "List two contacts, Bo (bo@example.com) and Li (li@example.com), as a JSON array.",
     {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
         "name": {"type": "string", "maxLength": 20}, "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]+$"}},
         "required": ["name", "email"], "additionalProperties": False}}),
]


def compiles(schema) -> bool:
    """llguidance compiles it and Python's jsonschema can check against it (its regular expressions
    are Python's: ECMA-only syntax such as \\p{Letter} is left out)."""
    if not isinstance(schema, dict) or not schema:
        return False
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError:
        return False
    return not LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))


def main() -> None:
    suite = Path(sys.argv[1])
    rows = []
    for path in sorted(suite.glob("*.json")):
        taken = 0
        for group in json.loads(path.read_text()):
            if taken == PER_FILE or not compiles(group["schema"]):
                continue
            taken += 1
            rows.append({"id": f"{path.stem}-{taken}", "source": f"JSON-Schema-Test-Suite draft2020-12/{path.name}: {group['description']} (adapted)",
                         "prompt": "Write one JSON value that is valid against this JSON Schema, and nothing else.\n\n"
                                   + json.dumps(group["schema"]), "schema": group["schema"]})
    for name, prompt, schema in APPLICATION:
        assert compiles(schema), name
        rows.append({"id": f"app-{name}", "source": "decodekit", "prompt": prompt, "schema": schema})
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} schemas to {OUT}")


if __name__ == "__main__":
    main()
