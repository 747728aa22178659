"""The OpenAI-compatible HTTP API (aiohttp): routes, validation, SSE, detokenization."""

from __future__ import annotations

from tetri_server.api.app import build_app
from tetri_server.api.server import drain, start_site

__all__ = ["build_app", "drain", "start_site"]
