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


# Answered as text, not JSON: a stream of server-sent events (beside its JSON body), Prometheus' format, the logs.
TEXT_2XX = {("get", "/metrics"): "text/plain", ("get", "/v1/functions/{name}/logs"): "text/plain"}
SSE_BESIDE_JSON = {"/v1/functions/{name}/invoke", "/v1/chat/completions", "/v1/completions", "/v1/responses"}


def test_every_operation_describes_its_2xx_body() -> None:
    """Each operation's success answer is a named schema of what it returns (issue 37, 4): a JSON body is a $ref to
    a component with its properties, never a bare or empty object; the text answers are text or SSE."""
    doc = document()
    schemas = doc["components"]["schemas"]
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            successes = {s: r for s, r in operation["responses"].items() if s.startswith("2")}
            assert successes, (method, path)
            for status, response in successes.items():
                content = response.get("content", {})
                where = (method, path, status, content)
                if (method, path) in TEXT_2XX:
                    assert set(content) == {TEXT_2XX[method, path]}, where
                    assert content[TEXT_2XX[method, path]]["schema"]["type"] == "string", where
                    continue
                expected = {"application/json", "text/event-stream"} if path in SSE_BESIDE_JSON and status == "200" \
                    else {"application/json"}
                assert set(content) == expected, where
                ref = content["application/json"]["schema"].get("$ref", "")
                assert ref.startswith("#/components/schemas/"), where
                body = schemas[ref.rsplit("/", 1)[-1]]
                assert body.get("type") == "object" and body.get("properties") and body.get("required"), where
