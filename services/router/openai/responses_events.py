"""A streamed response's events in OpenAI's order, each with its sequence number (pure).

    response.created, response.in_progress,
    [response.output_item.added, response.content_part.added,
     response.output_text.delta ..., response.output_text.done, response.content_part.done,
     response.output_item.done]                     the text, when there is any
    [response.output_item.added, response.function_call_arguments.delta,
     response.function_call_arguments.done, response.output_item.done] ...   each call
    response.completed

The text's item opens with its first piece of text; a call's item is sent whole once the
answer is done (its arguments as one delta), as the chat stream sends calls. Each event is
one SSE message `event: <type>` / `data: <json>`, as vLLM's server frames them. The caller
builds the final response from this stream's `message_id` and streamed text, so the items of
`response.completed` are the ones streamed.
"""

from __future__ import annotations

from services.router.openai.responses_objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    OutputFunctionCall,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
)


class ResponseEvents:
    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.text = ""  # the text streamed so far
        self._opened = False
        self._sequence_number = 0

    def _sse(self, event: ResponseEvent) -> bytes:
        event.sequence_number = self._sequence_number
        self._sequence_number += 1
        return f"event: {event.type}\ndata: {event.model_dump_json(by_alias=True)}\n\n".encode()

    def opening(self, response: ResponseObject) -> bytes:
        return b"".join((self._sse(ResponseLifecycleEvent(type="response.created", response=response)),
                         self._sse(ResponseLifecycleEvent(type="response.in_progress", response=response))))

    def text_delta(self, delta: str) -> bytes:
        """The events of a piece of the answer's text (none for an empty piece)."""
        if not delta:
            return b""
        events = []
        if not self._opened:
            self._opened = True
            item = OutputMessage(id=self.message_id, status="in_progress", content=[])
            events += [self._sse(OutputItemEvent(type="response.output_item.added", output_index=0, item=item)),
                       self._sse(ContentPartEvent(type="response.content_part.added", item_id=self.message_id,
                                                  output_index=0, part=OutputText(text="")))]
        self.text += delta
        events.append(self._sse(TextDeltaEvent(item_id=self.message_id, output_index=0, delta=delta)))
        return b"".join(events)

    def closing(self, response: ResponseObject) -> bytes:
        """The events that end the stream: the text's item done, each call, `response.completed`."""
        events = []
        for index, item in enumerate(response.output):
            if isinstance(item, OutputMessage):
                assert self._opened and item.id == self.message_id, "the message item is the streamed text's"
                events += self._message_done(item, index)
            else:
                events += self._call(item, index)
        events.append(self._sse(ResponseLifecycleEvent(type="response.completed", response=response)))
        return b"".join(events)

    def _message_done(self, item: OutputMessage, index: int) -> list[bytes]:
        part = item.content[0]
        return [self._sse(TextDoneEvent(item_id=item.id, output_index=index, text=part.text)),
                self._sse(ContentPartEvent(type="response.content_part.done", item_id=item.id, output_index=index,
                                           part=part)),
                self._sse(OutputItemEvent(type="response.output_item.done", output_index=index, item=item))]

    def _call(self, item: OutputFunctionCall, index: int) -> list[bytes]:
        opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
        return [self._sse(OutputItemEvent(type="response.output_item.added", output_index=index, item=opened)),
                self._sse(ArgumentsDeltaEvent(item_id=item.id, output_index=index, delta=item.arguments)),
                self._sse(ArgumentsDoneEvent(item_id=item.id, output_index=index, name=item.name,
                                             arguments=item.arguments)),
                self._sse(OutputItemEvent(type="response.output_item.done", output_index=index, item=item))]

    def error(self, code: str | None, message: str, param: str | None) -> bytes:
        """A failure once streaming: an `error` event, and the stream ends."""
        return self._sse(ErrorEvent(code=code, message=message, param=param))
