"""Fixtures of the vLLM tier: one real vLLM server for the whole session, and a reference model.

The server runs from ``.venv-vllm`` (``scripts/vllm_env.sh``) and serves the default tiny model,
built here. To reuse a server that is already running (while developing), set
``STALEBOUND_VLLM_URL`` and ``STALEBOUND_VLLM_MODEL_DIR`` (the checkpoint it was started with; it
must have the dev-mode endpoints and ``--enable-scale-out``).

Tests that reload weights put the original weights back (with a newer version) before they end,
so every test starts from the original weights; versions only grow.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("httpx")

from vllm_reference import Server  # noqa: E402

from stalebound.engines.models import build_default_model, load_model  # noqa: E402
from stalebound.engines.vllm_server import start_vllm_server  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    url = os.environ.get("STALEBOUND_VLLM_URL")
    if url:
        model = os.environ.get("STALEBOUND_VLLM_MODEL_DIR")
        if not model:
            pytest.fail("STALEBOUND_VLLM_URL is set: set STALEBOUND_VLLM_MODEL_DIR too")
        yield Server(url.rstrip("/"), Path(model), "(external server)")
        return
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_default_model(root / "model", seed=0)
    server = start_vllm_server(model_dir, 0, log_path=root / "server.log")
    try:
        yield Server(server.url, server.model_dir, str(server.log_path))
    finally:
        server.stop()


@pytest.fixture(scope="session")
def alt_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the same architecture with other weights (another seed)."""
    return build_default_model(tmp_path_factory.mktemp("alt-model") / "model", seed=1)


@pytest.fixture(scope="session")
def reference(vllm_server: Server) -> Any:
    return load_model(vllm_server.model_dir)


@pytest.fixture(scope="session")
def alt_reference(alt_model_dir: Path) -> Any:
    return load_model(alt_model_dir)
