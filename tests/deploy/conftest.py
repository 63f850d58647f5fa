"""Fixtures of the deploy tests that more than one module uses."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def openai_frontend(server, served_repo, tmp_path_factory, start_frontend):
    """``python -m deploy.openai`` serving the session's LLM (``llm``) and encoder (``minilm``), without an API
    key; yields its base URL."""
    log_path = tmp_path_factory.mktemp("openai-embed") / "frontend.log"
    with start_frontend(served_repo, server.grpc_url, log_path, "--models", "llm", "minilm") as url:
        yield url
