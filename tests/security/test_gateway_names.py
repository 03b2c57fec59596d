"""Issue 12, items 1 and 9: what the gateway tells a caller about the models it serves.

With keys on, before the fix, ``/openapi.json`` and ``/metrics`` named every served model to anyone,
``/readyz`` counted them, and ``/v1/models`` told every key holder (restricted keys too) each
predictor's address and pid, which reach a predictor around the gateway's keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from universal_gateway.app import Gateway
from universal_gateway.auth import ApiKeys
from universal_gateway.backends import Backends, ModelState, ModelView
from universal_predictors.catalog import Task

ADMIN = "sk-admin"
LIMITED = "sk-limited"
PUBLIC = "public-model"
SECRET = "secret-model"


class TwoModels(Backends):
    """Two listed models that run somewhere (an address and a pid); nothing is ever proxied."""

    def __init__(self) -> None:
        self.views = [
            ModelView(
                name=name,
                task=Task.EMBED,
                backend="test",
                state=ModelState.READY,
                endpoint=f"http://127.0.0.1:{port}",
                pid=pid,
            )
            for name, port, pid in ((PUBLIC, 41001, 4242), (SECRET, 41002, 4343))
        ]

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def models(self) -> list[ModelView]:
        return self.views

    def lease(self, name: str) -> contextlib.AbstractAsyncContextManager[str]:
        raise AssertionError("nothing here is proxied")


@pytest.fixture
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    keys = ApiKeys.of({ADMIN: None, LIMITED: frozenset({PUBLIC})})
    async with Gateway(TwoModels(), keys=keys).serving() as url, httpx.AsyncClient(base_url=url) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path", ["/openapi.json", "/metrics", "/v1/models", "/v1/models/secret-model"])
async def test_routes_that_name_models_need_a_key(gateway: httpx.AsyncClient, path: str) -> None:
    response = await gateway.get(path)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"
    assert SECRET not in response.text


async def test_probes_answer_without_a_key_and_name_no_model(gateway: httpx.AsyncClient) -> None:
    for path in ("/healthz", "/readyz"):
        response = await gateway.get(path)
        assert response.status_code == 200
        assert response.json() in ({"status": "ok"}, {"status": "ready"})


async def test_openapi_lists_only_the_models_the_key_may_use(gateway: httpx.AsyncClient) -> None:
    limited = await gateway.get("/openapi.json", headers=bearer(LIMITED))
    assert limited.status_code == 200
    assert PUBLIC in limited.text
    assert SECRET not in limited.text
    admin = await gateway.get("/openapi.json", headers=bearer(ADMIN))
    assert SECRET in admin.text


async def test_metrics_need_a_key_for_every_model(gateway: httpx.AsyncClient) -> None:
    limited = await gateway.get("/metrics", headers=bearer(LIMITED))
    assert limited.status_code == 403
    assert SECRET not in limited.text
    admin = await gateway.get("/metrics", headers=bearer(ADMIN))
    assert admin.status_code == 200
    assert "universal_gateway_requests_total" in admin.text


@pytest.mark.parametrize("key", [ADMIN, LIMITED])
async def test_model_cards_do_not_say_where_a_predictor_listens(gateway: httpx.AsyncClient, key: str) -> None:
    cards = (await gateway.get("/v1/models", headers=bearer(key))).json()["data"]
    assert cards
    one = (await gateway.get(f"/v1/models/{PUBLIC}", headers=bearer(key))).json()
    for card in [*cards, one]:
        assert "endpoint" not in card
        assert "pid" not in card
        assert "127.0.0.1" not in str(card)
        assert "4242" not in str(card)
    if key == LIMITED:
        assert [card["id"] for card in cards] == [PUBLIC]
