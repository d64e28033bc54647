"""The server's model names: which names `protocol.parse` accepts, the 404 for any other,
the served name `kvpool serve` derives from its flags, and the KV namespace that ignores it."""
from __future__ import annotations

import argparse

import pytest

from engine.server.app import model_names
from engine.server.protocol import BadRequest, ModelNotFound, parse
from kvpool_cli.serve import add_engine_args, engine_config
from tests.engine.conftest import make_engine

NAMES = ("smollm2-135m", "SmolLM2-135M-Instruct")


@pytest.mark.parametrize("model", [*NAMES, None])
def test_the_served_name_the_model_s_own_name_or_none_are_accepted(model: str | None) -> None:
    body = {"prompt": "Hi"} if model is None else {"prompt": "Hi", "model": model}
    assert parse(body, False, NAMES, default_max_tokens=16).prompt == "Hi"


def test_a_single_name_is_one_name_not_its_characters() -> None:
    """The router passes one served name as a string: "s" must not pass as a substring."""
    assert parse({"prompt": "Hi", "model": "smollm2-135m"}, False, "smollm2-135m", 16).prompt == "Hi"
    with pytest.raises(ModelNotFound):
        parse({"prompt": "Hi", "model": "s"}, False, "smollm2-135m", 16)


@pytest.mark.parametrize("chat", [False, True])
def test_an_unknown_model_is_a_404_not_found(chat: bool) -> None:
    body = {"model": "gpt-17", **({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})}
    with pytest.raises(ModelNotFound) as info:
        parse(body, chat, NAMES, 16)
    err = info.value
    assert isinstance(err, BadRequest) and err.status == 404  # a BadRequest: the router's parse refuses it too
    assert err.body() == {"error": {
        "message": "the model 'gpt-17' does not exist; this server serves 'smollm2-135m' "
                   "(also accepted: 'SmolLM2-135M-Instruct')",
        "type": "NotFoundError", "param": "model", "code": "model_not_found"}}


@pytest.mark.parametrize("model", [17, ["smollm2-135m"], {"id": "x"}, True])
def test_a_model_that_is_not_a_string_is_a_400(model: object) -> None:
    with pytest.raises(BadRequest) as info:
        parse({"prompt": "Hi", "model": model}, False, NAMES, 16)
    assert info.value.status == 400 and not isinstance(info.value, ModelNotFound)
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv,served", [((), "smollm2-135m"), (("--model", "SmolLM2-135M-Instruct"),
                                                                  "SmolLM2-135M-Instruct"),
                                         (("--served-model-name", "smol"), "smol")])
def test_serve_serves_the_name_it_was_started_with(argv: tuple[str, ...], served: str) -> None:
    assert engine_config(_args(*argv)).served_model_name == served


def test_the_kv_namespace_does_not_depend_on_the_served_name(loaded) -> None:  # noqa: ANN001
    plain = make_engine(loaded, kv_cache_bytes=4 << 20)
    alias = make_engine(loaded, kv_cache_bytes=4 << 20, served_model_name="smollm2-135m")
    assert alias.model_name == "smollm2-135m" and plain.model_name == "SmolLM2-135M-Instruct"
    assert alias.fingerprint == plain.fingerprint and plain.fingerprint.startswith("SmolLM2-135M-Instruct|")
    assert model_names(alias) == NAMES
    assert model_names(plain) == ("SmolLM2-135M-Instruct",)  # the same name is listed once
