"""/openapi.json describes the API as served: error bodies per status, the bearer scheme, 202 and SSE, /metrics text."""

from pathlib import Path
from types import SimpleNamespace

from lorafaas.platform.gateway.app import create_app


def document() -> dict:
    service = SimpleNamespace(store=None, models=SimpleNamespace(models_dir=Path("/srv/home/models")),
                              adapters=SimpleNamespace(root=Path("/srv/home/adapters")))
    return create_app(service, metrics=None).openapi()


def test_every_error_status_has_the_error_body_and_routes_name_their_own() -> None:
    doc = document()
    error = doc["components"]["schemas"]["ErrorBody"]
    assert error["properties"]["error"]["$ref"].endswith("/ErrorDetail")
    invoke = doc["paths"]["/v1/functions/{name}/invoke"]["post"]["responses"]
    assert {"400", "401", "404", "413", "422", "431", "503", "504"} <= set(invoke)
    deploy = doc["paths"]["/v1/functions"]["post"]["responses"]
    assert {"201", "403", "409", "413", "429", "507"} <= set(deploy)
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")) and path != "/readyz":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema["$ref"].endswith("/ErrorBody"), (method, path, status)
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # FastAPI's own 422 body is never sent


def test_security_async_streaming_and_text_are_described() -> None:
    doc = document()
    scheme = doc["components"]["securitySchemes"]["apiKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert doc["paths"]["/v1/functions"]["get"]["security"] == [{"apiKey": []}]
    assert "security" not in doc["paths"]["/healthz"]["get"]
    invoke = doc["paths"]["/v1/functions/{name}/invoke"]["post"]["responses"]
    assert "text/event-stream" in invoke["200"]["content"] and "Location" in invoke["202"]["headers"]
    assert "text/event-stream" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    seed = doc["components"]["schemas"]["InvokeBody"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (-(2**53 - 1), 2**53 - 1)


def test_listing_invocations_is_described_with_its_filters_and_bounds() -> None:
    listing = document()["paths"]["/v1/invocations"]["get"]
    assert listing["security"] == [{"apiKey": []}]
    params = {p["name"]: p["schema"] for p in listing["parameters"]}
    assert set(params) == {"function", "status", "limit"}
    assert (params["limit"]["minimum"], params["limit"]["maximum"], params["limit"]["default"]) == (1, 1000, 100)
    assert set(params["status"]["anyOf"][0]["enum"]) == {"queued", "running", "succeeded", "failed", "cancelled"}
    assert "401" in listing["responses"]


def test_the_log_cuts_are_described_with_their_bounds() -> None:
    params = {p["name"]: p["schema"] for p in document()["paths"]["/v1/functions/{name}/logs"]["get"]["parameters"]}
    assert (params["tail"]["anyOf"][0]["minimum"], params["tail"]["anyOf"][0]["maximum"]) == (0, 100_000)
    assert params["since"]["anyOf"][0]["minimum"] == 0
