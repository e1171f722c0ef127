"""A streamed OpenAI text completion of `tokens` chunks (" w0", " w1", ...), for the test servers the serving
benchmarks talk to."""

from __future__ import annotations

import asyncio
import json

from starlette.responses import StreamingResponse


def completion_stream(tokens: int, delay_s: float = 0.005) -> StreamingResponse:
    async def events():
        for i in range(tokens):
            await asyncio.sleep(delay_s)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' w{i}'}]})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
