"""What the API-key end-to-end tests share (test_router_auth.py, test_router_admission.py):
an `openai` client sending one key, and waiting until a key refused with 429 is served again."""

from __future__ import annotations

import openai

from launch.stack import LocalStack
from tests.waiting import wait_for


def keyed_client(stack: LocalStack, api_key: str, *, timeout_s: float) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s)


async def wait_served(api: openai.AsyncOpenAI, model: str, prompt: str, what: str) -> None:
    """Wait (10 s at most, `what` says for what) until a short completion of `prompt` is no
    longer refused as rate limited."""

    async def served() -> bool:
        try:
            await api.completions.create(model=model, prompt=prompt, max_tokens=2)
        except openai.RateLimitError:
            return False
        return True

    await wait_for(served, 10, what, interval_s=0.1)
