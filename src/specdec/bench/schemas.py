"""A JSON Schema validator for the subset the json-tasks data set uses: the bench checks every
constrained output with it, independently of the grammar library that constrained it (so a
matcher that lets an invalid output through is caught, not trusted).

Supported keywords: type (object, array, string, number, integer, boolean, null, or a list of
them), properties, required, additionalProperties (false, true or a schema), items, enum, const,
minItems, maxItems, minLength, maxLength, minimum, maximum; description and title are ignored.
A schema with any other keyword is refused (`check_supported`) rather than half-checked.
"""

from __future__ import annotations

import json

from ..errors import SpecdecError

KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "minItems",
            "maxItems", "minLength", "maxLength", "minimum", "maximum", "description", "title"}
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def check_supported(schema, where: str = "$") -> None:
    """SpecdecError naming the first keyword (with its place) this validator does not check."""
    if not isinstance(schema, dict):
        raise SpecdecError(f"schema at {where} must be an object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - KEYWORDS)
    if unknown:
        raise SpecdecError(f"schema at {where}: keyword(s) {', '.join(unknown)} not supported by the bench's validator")
    for name, sub in schema.get("properties", {}).items():
        check_supported(sub, f"{where}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        check_supported(schema["additionalProperties"], f"{where}.*")
    if "items" in schema:
        check_supported(schema["items"], f"{where}[]")


def _is_type(value, kind: str) -> bool:
    if kind == "integer":  # JSON has one number type: 3.0 is an integer, True is not
        return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind not in _TYPES:
        raise SpecdecError(f"unknown JSON Schema type {kind!r}")
    return isinstance(value, _TYPES[kind])


def validate(instance, schema: dict, where: str = "$") -> list[str]:
    """The ways `instance` breaks `schema` (empty: valid), each naming its place ($.field[0])."""
    problems = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is_type(instance, k) for k in kinds):
            return [f"{where}: expected {' or '.join(kinds)}, got {_json_type(instance)}"]
    if "enum" in schema and not any(_same(instance, v) for v in schema["enum"]):
        problems.append(f"{where}: {json.dumps(instance)[:40]} not one of {json.dumps(schema['enum'])[:80]}")
    if "const" in schema and not _same(instance, schema["const"]):
        problems.append(f"{where}: must be {json.dumps(schema['const'])[:40]}")
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        problems += [f"{where}: missing required {name!r}" for name in schema.get("required", []) if name not in instance]
        extra = schema.get("additionalProperties", True)
        for name, value in instance.items():
            if name in properties:
                problems += validate(value, properties[name], f"{where}.{name}")
            elif extra is False:
                problems.append(f"{where}: property {name!r} not allowed")
            elif isinstance(extra, dict):
                problems += validate(value, extra, f"{where}.{name}")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            problems.append(f"{where}: {len(instance)} items, fewer than {schema['minItems']}")
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            problems.append(f"{where}: {len(instance)} items, more than {schema['maxItems']}")
        if "items" in schema:
            for i, item in enumerate(instance):
                problems += validate(item, schema["items"], f"{where}[{i}]")
    if isinstance(instance, str):
        if len(instance) < schema.get("minLength", 0):
            problems.append(f"{where}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(instance) > schema["maxLength"]:
            problems.append(f"{where}: longer than {schema['maxLength']} characters")
    if _is_type(instance, "number"):
        if "minimum" in schema and instance < schema["minimum"]:
            problems.append(f"{where}: {instance} below the minimum {schema['minimum']}")
        if "maximum" in schema and instance > schema["maximum"]:
            problems.append(f"{where}: {instance} above the maximum {schema['maximum']}")
    return problems


def _same(a, b) -> bool:
    """JSON equality: 1 == 1.0, but True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


def check_output(text: str, schema: dict, truncated: bool = False) -> str | None:
    """Why `text` (a whole generated output) is not a valid instance of `schema`, or None where it
    is. truncated: the output stopped at its token limit (an unfinished output is invalid, and says so)."""
    if truncated:
        return "truncated: the token limit came before the JSON ended"
    try:
        instance = json.loads(text)
    except ValueError as error:
        return f"not JSON: {error}"
    problems = validate(instance, schema)
    return "; ".join(problems[:3]) if problems else None
