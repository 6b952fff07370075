"""The OpenAPI document: valid 3.1, served without credentials, and complete.

A route added to ``add_routes`` without an ``Operation`` in ``proxy/openapi.py`` fails
here, so CI keeps the document (and with it the fuzz test's reach) whole.
"""

from __future__ import annotations

from typing import Any

import orjson
from openapi_spec_validator import OpenAPIV31SpecValidator

from rollout_proxy.app import create_app
from rollout_proxy.proxy.openapi import ALIASES, build_document, document_bytes
from rollout_proxy.proxy.schemas import ChatRequest, SessionCreate
from rollout_proxy.settings import Settings
from tests.harness import ADMIN_KEY, ProxyHarness

METHODS = ("get", "post", "put", "patch", "delete")


def operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): spec
        for path, item in document["paths"].items()
        for method, spec in item.items()
        if method in METHODS
    }


def test_the_document_is_valid_openapi_3_1():
    document = build_document()
    assert document["openapi"].startswith("3.1")
    OpenAPIV31SpecValidator(document).validate()


def test_every_registered_route_is_documented_and_nothing_else():
    app = create_app(Settings(admin_key=ADMIN_KEY))
    registered = {
        (route.method, ALIASES.get(route.resource.canonical, route.resource.canonical))  # the Messages aliases
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"  # aiohttp adds HEAD to every GET
    }
    assert registered == set(operations(build_document()))


def test_every_error_answer_is_an_openai_error_body_and_retryable_ones_say_when():
    """The Messages routes' errors are Anthropic's shape instead (its clients read that one)."""
    document = build_document()
    components = document["components"]
    for (method, path), spec in operations(document).items():
        body = "AnthropicErrorBody" if path.startswith("/v1/messages") else "ErrorBody"
        for status, answer in spec["responses"].items():
            if int(status) < 400 or path == "/readyz":
                continue
            assert "$ref" in answer, f"{method} {path} {status}"
            resolved = components["responses"][answer["$ref"].rsplit("/", 1)[1]]
            schema = resolved["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{body}"}, f"{method} {path} {status}"
            assert ("Retry-After" in resolved["headers"]) == (status in ("503", "504")), f"{method} {path} {status}"
    assert set(components["schemas"]["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}


def test_security_per_operation():
    document = build_document()
    schemes = document["components"]["securitySchemes"]
    assert {scheme["scheme"] for scheme in schemes.values()} == {"bearer"}
    found = {key: [name for entry in spec["security"] for name in entry] for key, spec in operations(document).items()}
    assert found[("POST", "/v1/chat/completions")] == ["sessionToken"]
    assert found[("POST", "/v1/sessions")] == ["adminKey"]
    assert found[("GET", "/v1/sessions/{session_id}/trajectory")] == ["adminKey", "sessionToken"]
    assert found[("GET", "/healthz")] == [] and found[("GET", "/openapi.json")] == []
    assert all(set(names) <= set(schemes) for names in found.values())


def test_request_bodies_come_from_the_handlers_models():
    """The document follows the request models: their fields and required lists, as pydantic states them."""
    document = build_document()
    schemas = document["components"]["schemas"]
    chat = operations(document)[("POST", "/v1/chat/completions")]["requestBody"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ChatRequest"}
    for model in (ChatRequest, SessionCreate):
        generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
        generated.pop("$defs", None)
        assert schemas[model.__name__] == generated


def test_the_append_route_takes_an_idempotency_key():
    append = operations(build_document())[("POST", "/v1/sessions/{session_id}/messages")]
    headers = {parameter["name"]: parameter for parameter in append["parameters"] if parameter["in"] == "header"}
    assert headers["Idempotency-Key"]["required"] is False
    assert "409" in append["responses"]


def test_answers_carry_the_token_extensions():
    schemas = build_document()["components"]["schemas"]
    assert "prompt_token_ids" in schemas["ChatCompletion"]["required"]
    assert "token_ids" in schemas["ChatCompletionChoice"]["required"]
    assert {"prompt_token_ids", "token_ids"} <= set(schemas["Response"]["required"])
    assert "total_token_ids" in schemas["Trajectory"]["properties"]


async def test_served_without_credentials_as_json():
    async with ProxyHarness.running(engine_urls=["http://127.0.0.1:9"]) as harness:
        status, body = await harness.request("GET", "/openapi.json", token=None)
        assert status == 200
        assert body == orjson.loads(document_bytes()) == orjson.loads(orjson.dumps(build_document()))
        assert document_bytes() is document_bytes()  # built once


def test_the_documented_requests_take_images_as_each_api_sends_them():
    """The document is the edge's models: Chat ``image_url``, Responses ``input_image``, Messages ``image`` blocks
    (a base64 or url source)."""
    schemas = build_document()["components"]["schemas"]
    assert schemas["ImageUrlPart"]["properties"]["type"]["const"] == "image_url"
    assert schemas["ImageUrl"]["required"] == ["url"]
    assert {"image_url", "file_id"} <= set(schemas["InputImagePart"]["properties"])
    assert schemas["ImageBlock"]["required"] == ["type", "source"]
    assert {"Base64Source", "UrlSource"} <= set(schemas)
