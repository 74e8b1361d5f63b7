"""Reading a peer's answer without trusting its size."""

from __future__ import annotations

import aiohttp


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or its first `limit` + 1 bytes when it is longer (the caller tells by the length).

    `content.read(n)` returns what has arrived so far, which may be less than n: a body must be
    read to its end (or to the cap) before it is judged.
    """
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            return bytes(body[: limit + 1])
    return bytes(body)
