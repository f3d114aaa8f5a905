"""The recipe's factories: the backend and the engine kind pick what runs where, no branches."""

from __future__ import annotations

from pathlib import Path

from stalebound.config import load_config
from stalebound.engines.sglang import SGLangEngine
from stalebound.engines.vllm import VLLMEngine
from stalebound.train.backends import LocalBackend, RayBackend, make_backend, make_engines


def test_the_backend_is_the_one_the_config_names() -> None:
    assert isinstance(make_backend(load_config()), LocalBackend)
    assert isinstance(make_backend(load_config(overrides=["backend=ray"])), RayBackend)


def test_http_engine_kinds_are_clients_of_each_server_whatever_the_backend(
    tmp_path: Path,
) -> None:
    urls = "engine.urls=[http://127.0.0.1:1,http://127.0.0.1:2]"
    for backend in ("local", "ray"):
        cfg = load_config(overrides=["engine.kind=vllm", urls, f"backend={backend}"])
        engines = make_engines(cfg, make_backend(cfg), tmp_path, 0)
        assert [type(c) for c in engines.clients] == [VLLMEngine, VLLMEngine]
        assert [c.url for c in engines.clients] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        assert engines.weights_on_disk and engines.serves_other_weights
        assert engines.local == []
    cfg = load_config(overrides=["engine.kind=sglang", "engine.urls=[http://127.0.0.1:3]"])
    engines = make_engines(cfg, make_backend(cfg), tmp_path, 0)
    assert engines.engine is engines.clients[0]
    assert isinstance(engines.engine, SGLangEngine)


def test_continue_mode_uses_vllms_token_endpoint(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=["engine.kind=vllm", "engine.urls=[http://h:1]", "engine.interrupt_mode=continue"]
    )
    (client,) = make_engines(cfg, make_backend(cfg), tmp_path, 0).clients
    assert client.api == "generate" and client.interrupt_mode == "continue"


def test_sglang_clients_take_the_configured_interrupt_mode(tmp_path: Path) -> None:
    for mode in ("continue", "resubmit"):
        cfg = load_config(
            overrides=[
                "engine.kind=sglang",
                "engine.urls=[http://h:1]",
                f"engine.interrupt_mode={mode}",
            ]
        )
        (client,) = make_engines(cfg, make_backend(cfg), tmp_path, 0).clients
        assert client.interrupt_mode == mode
