"""Every response body in /openapi.json is typed to its leaves: no property is an untyped object (`{"type":
"object"}` with neither properties nor a typed `additionalProperties`) or an untyped value (`{}`), except the JSON
Schema passthroughs allowed below by name. Issue 37: no `dict[str, Any]` crosses the HTTP boundary."""

from pathlib import Path
from types import SimpleNamespace

from lorafaas.platform.gateway.app import create_app

# Where a response may hold arbitrary JSON on purpose (a JSON Schema passed through as given), by place, each with
# why. None today: JSON Schemas come only in requests (chat tools' parameters, response_format's schema).
ALLOWED_UNTYPED: dict[str, str] = {}
_REF = "#/components/schemas/"


def document() -> dict:
    service = SimpleNamespace(store=None, models=SimpleNamespace(models_dir=Path("/srv/home/models")),
                              adapters=SimpleNamespace(root=Path("/srv/home/adapters")))
    return create_app(service, metrics=None).openapi()


def untyped(schema: dict) -> bool:
    if not schema or schema == {"additionalProperties": True}:
        return True
    if schema.get("type") != "object" or "properties" in schema:
        return False
    values = schema.get("additionalProperties", True)
    return values is True or values == {}


def untyped_places(doc: dict) -> dict[str, dict]:
    """Each untyped schema reachable from a response, by where it is (`Struct.field`, `[]` items, `{}` values)."""
    components = doc["components"]["schemas"]
    found: dict[str, dict] = {}
    seen: set[str] = set()

    def walk(schema: dict | bool, where: str) -> None:
        if not isinstance(schema, dict):
            return
        if "$ref" in schema:
            name = schema["$ref"].removeprefix(_REF)
            if name not in seen:
                seen.add(name)
                walk(components[name], name)
            return
        if untyped(schema):
            found[where] = schema
            return
        for member in (*schema.get("anyOf", ()), *schema.get("oneOf", ()), *schema.get("allOf", ())):
            walk(member, where)
        for field, value in schema.get("properties", {}).items():
            walk(value, f"{where}.{field}")
        if schema.get("type") == "array" and schema.get("maxItems") != 0:  # (an empty tuple has no items)
            walk(schema.get("items", {}), f"{where}[]")
        if isinstance(schema.get("additionalProperties"), dict):
            walk(schema["additionalProperties"], f"{where}{{}}")

    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                for media, content in response.get("content", {}).items():
                    walk(content.get("schema", {}) if media == "application/json" else {"type": "string"},
                         f"{method.upper()} {path} {status}")
    return found


def test_no_response_property_is_an_untyped_object() -> None:
    found = untyped_places(document())
    assert set(found) - set(ALLOWED_UNTYPED) == set(), found
    assert set(ALLOWED_UNTYPED) <= set(found), "an allowed passthrough is typed now: drop it from the list"


def test_the_walk_finds_an_untyped_object_and_value() -> None:
    body = {"content": {"application/json": {"schema": {"$ref": _REF + "X"}}}}
    doc = {"paths": {"/x": {"get": {"responses": {"200": body}}}},
           "components": {"schemas": {"X": {"type": "object", "properties": {
               "loose": {"anyOf": [{"type": "object"}, {"type": "null"}]}, "any": {"type": "array"},
               "none": {"type": "array", "maxItems": 0},
               "map": {"type": "object", "additionalProperties": {"type": "number"}}}}}}}
    assert set(untyped_places(doc)) == {"X.loose", "X.any[]"}
