"""The shared bearer-token check (serving.common.auth) on a minimal app, its logging, and SWIFTSERVE_API_KEY."""

import runpy
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import serving.common.constants
from disagg.api.server import create_oip_api, render_oip_error
from serving.api.models import ServedModels
from serving.api.server import create_images_api
from serving.common.auth import api_key_dependencies
from serving.common.http import install_error_handling
from serving.engine import LocalBackend
from tests.helpers.oip_fakes import FakeBackend, app_config

KEY = "k3y-Zq81-never-logged"


def make_client(api_key: str) -> TestClient:
    app = FastAPI()
    install_error_handling(app, render_oip_error, max_body_bytes=1024)

    @app.get("/secret", dependencies=api_key_dependencies(api_key))
    async def secret() -> dict[str, str]:
        return {"ok": "yes"}

    return TestClient(app)


def test_no_key_means_no_check() -> None:
    assert api_key_dependencies("") == []
    assert make_client("").get("/secret").json() == {"ok": "yes"}


@pytest.mark.parametrize(
    ("authorization", "status", "challenge"),
    [
        (None, 401, "Bearer"),
        (f"Basic {KEY}", 401, "Bearer"),
        ("Bearer", 401, "Bearer"),
        (KEY, 401, "Bearer"),
        (f"Bearer {KEY[:-1]}", 401, 'Bearer error="invalid_token"'),
        (f"Bearer {KEY}x", 401, 'Bearer error="invalid_token"'),
        (f"Bearer {KEY.upper()}", 401, 'Bearer error="invalid_token"'),
        (f"Bearer {KEY}", 200, None),
        (f"bearer {KEY}", 200, None),  # the scheme is case-insensitive (RFC 7235)
        (f"Bearer  {KEY} ", 200, None),  # so is whitespace around the token
    ],
)
def test_only_the_exact_bearer_key_passes(authorization: str | None, status: int, challenge: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = make_client(KEY).get("/secret", headers=headers)
    assert response.status_code == status
    assert response.headers.get("www-authenticate") == challenge
    assert KEY not in response.text


def test_a_non_ascii_key_is_compared_as_utf8_bytes() -> None:
    key = "clé-ünïcode"
    client = make_client(key)
    assert client.get("/secret", headers={"Authorization": b"Bearer " + key.encode()}).status_code == 200
    assert client.get("/secret", headers={"Authorization": b"Bearer cle-unicode"}).status_code == 401



def test_neither_the_key_nor_a_presented_token_is_logged(
    all_logs: pytest.LogCaptureFixture, tiny_engine, fast_config
) -> None:
    presented = "presented-t0ken-also-secret"
    backend = LocalBackend.for_engine(tiny_engine, fast_config)
    try:
        oip = TestClient(create_oip_api(FakeBackend(), app_config(), api_key=KEY))
        images = TestClient(create_images_api(ServedModels.one(backend, fast_config), api_key=KEY))
        for client, path in ((oip, "/models/ctr/infer"), (images, "/v1/images/generations")):
            for authorization in (f"Bearer {presented}", f"Basic {KEY}", f"Bearer {KEY}x", None):
                headers = {} if authorization is None else {"Authorization": authorization}
                assert client.post(f"{path}?api_key={presented}", json={}, headers=headers).status_code == 401
    finally:
        backend.close()
    text = "\n".join(r.getMessage() for r in all_logs.records if not r.name.startswith("httpx"))  # not the client's
    assert "refused POST /models/ctr/infer: wrong API key" in text  # refusals are logged ...
    assert "refused POST /v1/images/generations: not a Bearer token" in text
    assert KEY not in text and presented not in text  # ... without any secret


@pytest.mark.parametrize(("value", "expected"), [(None, ""), ("", ""), ("  \n", ""), ("s3cret\n", "s3cret")])
def test_api_key_comes_from_swiftserve_api_key(monkeypatch, value: str | None, expected: str) -> None:
    if value is None:
        monkeypatch.delenv("SWIFTSERVE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SWIFTSERVE_API_KEY", value)
    fresh = runpy.run_path(str(Path(serving.common.constants.__file__)))  # the module itself is left alone
    assert fresh["API_KEY"] == expected
