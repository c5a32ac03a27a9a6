"""The compose file's `vllm-cpu` profile on a real Docker engine: the vLLM CPU image builds
from the repository and a prefill/decode pair of vLLM workers serves a completion through
the router (the prompt's KV pulled by the decode worker).

Slow (a ~2.5 GB image; minutes to build on the vfs storage driver): it runs from
`make compose-vllm-check` (TANDEM_COMPOSE_VLLM=1), not in `make test`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import pytest

from tests.compose.docker_stack import ROOT, TEST_VLLM_CPU_IMAGE, ComposeStack, base_image

pytestmark = [pytest.mark.timeout(3600),
              pytest.mark.skipif(os.environ.get("TANDEM_COMPOSE_VLLM") != "1",
                                 reason="the vllm-cpu profile runs in `make compose-vllm-check`")]


def test_vllm_cpu_profile_serves_a_prefill_decode_completion(tandem_image: str) -> None:
    images = {"TANDEM_IMAGE": tandem_image, "TANDEM_NATS_IMAGE": tandem_image,
              "TANDEM_VLLM_CPU_IMAGE": TEST_VLLM_CPU_IMAGE, "TANDEM_BASE_IMAGE": base_image()}
    if any(Path(ROOT, "compose", "wheels").glob("torch-*.whl")):
        images["TORCH_INDEX"] = ""  # torch from the copied wheel; no index to reach
    stack = ComposeStack(profiles=("vllm-cpu",), images=images)
    try:
        started = time.monotonic()
        stack.compose("build", "decode-vllm-cpu", timeout_s=3600)
        print(f"\nvLLM CPU image {TEST_VLLM_CPU_IMAGE} built in {time.monotonic() - started:.1f} s")
        started = time.monotonic()
        stack.up(ready_timeout_s=900)
        stack.wait_workers("prefill", 1, timeout_s=120)
        print(f"vllm-cpu stack ready in {time.monotonic() - started:.1f} s")

        api = openai.OpenAI(base_url=stack.router_url + "/v1", api_key=stack.api_key(), timeout=300, max_retries=0)
        prompt = " ".join(f"word{index}" for index in range(300))  # beyond local_prefill_tokens: P/D
        reply = api.completions.create(model="tiny", prompt=prompt, max_tokens=8)
        print(f"completion: {reply.choices[0].text!r} ({reply.usage})")
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        assert stack.router_metric("tandem_router_disaggregated_requests_total") == 1
        assert stack.router_metric("tandem_router_kv_pulled_tokens_total") > 0
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.down()
        assert stack.leftovers() == {}
