"""How many tokens a request may generate: the one it asks for within its function's bounds, or a default that fits.

A request that omits `max_tokens` gets min(the route's default, the function's `max_tokens_limit`, the room left in
the backbone's context); the instance applies the last bound once it has tokenized the prompt (it never generates past
the context), so the gateway bounds the default by the context length itself.
"""

from __future__ import annotations

import asyncio
import json

from lorafaas.platform.gateway.openai_errors import InvalidParameter
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import FunctionSpec


async def max_tokens_for(service: FunctionService, spec: FunctionSpec, requested: int | None, default: int,
                         param: str = "max_tokens") -> int:
    context = await asyncio.to_thread(_context_length, service, spec.backbone)
    if requested is None:
        return max(1, min(default, spec.max_tokens_limit, context - 1 if context else default))
    if requested > spec.max_tokens_limit:
        raise InvalidParameter(param, f"{param} is {requested}; function {spec.name} allows at most "
                                      f"{spec.max_tokens_limit} (its max_tokens_limit)")
    if context and requested >= context:
        raise InvalidParameter(param, f"{param} is {requested}; the context window of {spec.backbone} is {context} "
                                      "tokens, prompt included")
    return requested


def _context_length(service: FunctionService, backbone: str) -> int | None:
    """The backbone's context window as its instances use it (`max_position_embeddings`), None if not stated."""
    try:
        config = json.loads((service.models.path(backbone) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    return None
