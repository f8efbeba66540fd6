"""Requests that the data-parallel server tests (local replicas, Ray actor replicas) send alike:
many at once, most streamed, and what each replica generated for them, from /metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import openai

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}  # every request runs to max_tokens


async def stream_text(aclient, model: str, prompt: str, max_tokens: int) -> str:
    stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY)
    return "".join([c.choices[0].text async for c in stream])


async def stream_outcome(aclient, model: str, prompt: str, max_tokens: int) -> tuple[str, str, float]:
    """("ok", its text, when it ended) or ("error", the API error's message, when it ended): a
    stream of a replica that may be killed under it."""
    try:
        return "ok", await stream_text(aclient, model, prompt, max_tokens), time.monotonic()
    except openai.APIError as e:
        return "error", e.message, time.monotonic()


def answer_concurrently(api_url: str, model: str, prompts: Sequence[str], max_tokens: Sequence[int]) -> list[str]:
    """Every prompt's greedy completion, all sent at once over one client, every fourth not
    streamed."""

    async def one(aclient, i: int) -> str:
        if i % 4 == 3:
            out = await aclient.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens[i], **GREEDY)
            return out.choices[0].text
        return await stream_text(aclient, model, prompts[i], max_tokens[i])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=api_url, api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(len(prompts))))

    return asyncio.run(all_of_them())


def generated_by_engine(before: dict, after: dict, engines: Sequence[int] = (0, 1)) -> list[float]:
    """The tokens each engine generated between two ``scrape(url, by_engine=True)``s."""
    key = "compiled_llm:generation_tokens_total{{engine={}}}"
    return [after[key.format(i)] - before.get(key.format(i), 0.0) for i in engines]
