"""vLLM's outputs of one request as Tandem's `EngineOutput`s (no I/O): new tokens, their
log-probabilities, the prompt's log-probabilities (which may come in parts under chunked
prefill: all go with the first token), and at the end the finish reason and the counts."""

from __future__ import annotations

from vllm.outputs import RequestOutput

from services.worker.engine import EngineOutput
from services.worker.vllm.sampling import prompt_token_logprobs, token_logprobs
from shared.errors import TandemError
from shared.schemas.generate import FinishReason, TokenLogprobs

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class OutputReader:
    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self._prompt_parts: list[TokenLogprobs | None] = []

    def read(self, output: RequestOutput) -> EngineOutput | None:
        """The output to send; None for one with nothing to send yet."""
        completion = output.outputs[0]
        new_tokens = list(completion.token_ids)
        self.completion_tokens += len(new_tokens)
        logprobs = token_logprobs(completion.logprobs, len(new_tokens))
        prompt_logprobs = None
        if output.prompt_logprobs:
            self._prompt_parts.extend(prompt_token_logprobs(output.prompt_logprobs) or ())
        if self._prompt_parts and new_tokens:
            prompt_logprobs, self._prompt_parts = self._prompt_parts, []
        if not output.finished:
            if not new_tokens:
                return None
            return EngineOutput(token_ids=new_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        reason = _FINISH_REASONS.get(completion.finish_reason or "")
        if reason is None:
            raise TandemError(f"vLLM ended request {self.request_id!r} with "
                              f"finish reason {completion.finish_reason!r}")
        return EngineOutput(token_ids=new_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                            finish_reason=reason, prompt_tokens=self.prompt_tokens,
                            cached_tokens=output.num_cached_tokens or 0, completion_tokens=self.completion_tokens)
