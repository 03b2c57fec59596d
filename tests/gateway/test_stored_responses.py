"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``, ``input_items``)
through real ``universal-runtime serve`` processes and the real ``openai`` SDK: locally in SQLite under the state
directory (kept across a gateway restart), and in a real ``redis-server`` shared by two gateways, as the replicas of
a cluster's gateway share one. Records belong to the API key that made them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.harness import GatewayProcess, running_gateway, write_chat_manifest
from tests.predictors.generation.tiny_llama import build_llama

MODEL = "tiny-chat"
KEYS = ("key-alice", "key-bob")


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    llama = build_llama(tmp_path_factory.mktemp("models") / "llama")
    folder = tmp_path_factory.mktemp("manifests")
    write_chat_manifest(folder, "chat", MODEL, llama)
    return folder


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("\n".join(KEYS) + "\n")
    return path


def client(gateway: GatewayProcess, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=300)


def ask(api: openai.OpenAI, text: str, **fields: object) -> openai.types.responses.Response:
    return api.responses.create(model=MODEL, input=text, max_output_tokens=6, temperature=0, **fields)  # type: ignore[call-overload,no-any-return]


def check_a_conversation(first_gateway: GatewayProcess, second_gateway: GatewayProcess) -> None:
    """One turn through ``first_gateway``, the next (naming it) through ``second_gateway``: the second answer is the
    one the whole conversation sent as input items gets, and every record is readable through either."""
    alice_a, alice_b = client(first_gateway), client(second_gateway)
    first = ask(alice_a, "Where is Oslo?", instructions="Be brief.")
    assert first.store is True
    assert alice_b.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = ask(alice_b, "And Rome?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The same conversation as explicit items (the first turn's instructions are not carried over, as OpenAI's rule).
    explicit = alice_a.responses.create(
        model=MODEL, max_output_tokens=6, temperature=0, store=False,
        input=[{"role": "user", "content": "Where is Oslo?"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And Rome?"}],
    )  # fmt: skip
    assert second.output_text == explicit.output_text
    assert second.usage is not None
    assert explicit.usage is not None
    assert second.usage.input_tokens == explicit.usage.input_tokens
    items = alice_a.responses.input_items.list(second.id)
    assert [item.type for item in items.data] == ["message"]
    assert items.data[0].content[0].text == "And Rome?"  # type: ignore[union-attr]
    # A third turn chains through both.
    third = ask(alice_a, "And Lima?", previous_response_id=second.id)
    assert third.usage is not None
    assert third.usage.input_tokens > second.usage.input_tokens


def test_stored_responses_chain_and_survive_a_gateway_restart(manifests: Path, keys_file: Path, tmp_path: Path) -> None:
    extra = ("--api-keys-file", str(keys_file))
    with running_gateway([manifests], tmp_path, *extra) as gateway:
        check_a_conversation(gateway, gateway)
        alice, bob = client(gateway), client(gateway, KEYS[1])
        kept = ask(alice, "Remember me")
        streamed_id = ""
        with alice.responses.stream(model=MODEL, input="Stream me", max_output_tokens=4, temperature=0) as stream:
            for event in stream:
                if event.type in ("response.completed", "response.incomplete"):
                    streamed_id = event.response.id
        # Recorded before its last event reached the client: the next turn can name it at once.
        assert alice.responses.retrieve(streamed_id).id == streamed_id
        assert ask(alice, "Next", previous_response_id=streamed_id).previous_response_id == streamed_id
        not_kept = ask(alice, "Forget me", store=False)
        assert not_kept.store is False
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(not_kept.id)
        # Another key sees nothing of alice's: not the response, not its chain.
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(kept.id)
        with pytest.raises(openai.BadRequestError) as caught:
            ask(bob, "Hi", previous_response_id=kept.id)
        assert caught.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
        assert "previous_response_id" in caught.value.body["message"]  # type: ignore[index]
    # The state directory is the same: the gateway comes back with its records.
    with running_gateway([manifests], tmp_path, *extra) as gateway:
        alice = client(gateway)
        assert alice.responses.retrieve(kept.id).output_text == kept.output_text
        deleted = alice.responses.delete(kept.id)
        assert deleted is None or getattr(deleted, "deleted", True)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(kept.id)
        raw = httpx.delete(f"{gateway.base_url}/responses/{kept.id}", headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert raw.status_code == 404
        assert raw.json()["error"]["code"] == "response_not_found"


def test_two_gateways_share_stored_responses_through_one_redis(
    manifests: Path, keys_file: Path, redis_url: str, tmp_path: Path
) -> None:
    extra = ("--api-keys-file", str(keys_file), "--responses-store", redis_url, "--responses-retention", "1h")
    with (
        running_gateway([manifests], tmp_path / "a", *extra) as first,
        running_gateway([manifests], tmp_path / "b", *extra) as second,
    ):
        check_a_conversation(first, second)
        made = ask(client(first), "Shared?")
        with pytest.raises(openai.NotFoundError):
            client(second, KEYS[1]).responses.retrieve(made.id)  # another key, another replica: still 404
        import redis

        ttl = redis.Redis.from_url(redis_url).ttl(f"universal-runtime:response:{_owner(KEYS[0])}:{made.id}")
        assert 3500 < ttl <= 3600  # the retention is the record's TTL


def _owner(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_with_the_store_off_nothing_is_kept_and_previous_response_id_says_why(manifests: Path, tmp_path: Path) -> None:
    with running_gateway([manifests], tmp_path, "--responses-store", "off") as gateway:
        api = client(gateway)
        made = ask(api, "Hi")
        assert made.store is False  # said, not pretended
        with pytest.raises(openai.NotFoundError) as missing:
            api.responses.retrieve(made.id)
        assert "--responses-store off" in missing.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as refused:
            ask(api, "Hi", previous_response_id=made.id)
        assert refused.value.body["code"] == "stored_responses_unavailable"  # type: ignore[index]
