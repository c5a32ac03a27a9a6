"""The orchestrator's command subjects (adapter): `OrchestratorCommand`s in on
`orchestrator.commands` and `WakeModel` in on `orchestrator.wake` (request/reply), each run
in its own task through the control plane's `execute`, its `CommandOutcome` sent back.

`control_plane.ControlPlane` starts and stops it. A malformed command is answered `refused`
at once; a command that raises is answered `failed` (a bug, logged); a command without a
reply subject is run only on the wake subject (a router's fire-and-forget wake).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from shared.bus import Bus, unsubscribe_quietly
from shared.codec import Codec, MalformedCounter, encode
from shared.schemas.orchestrator import CommandOutcome, OrchestratorCommand, WakeModel
from shared.subjects import Subjects
from shared.tasks import cancel_all

log = logging.getLogger(__name__)

Execute = Callable[[OrchestratorCommand], Awaitable[CommandOutcome]]


class CommandListener:
    def __init__(self, bus: Bus, subjects: Subjects, execute: Execute, malformed: MalformedCounter) -> None:
        self._bus = bus
        self._subjects = subjects
        self._execute = execute
        self._commands: Codec[OrchestratorCommand] = Codec(OrchestratorCommand, malformed)
        self._running: set[asyncio.Task[None]] = set()
        self._subscriptions: list = []

    async def start(self) -> None:
        client = self._bus.client
        self._subscriptions = [await client.subscribe(self._subjects.orchestrator_commands, cb=self._on_command),
                               await client.subscribe(self._subjects.orchestrator_wake, cb=self._on_wake)]
        await client.flush()

    async def stop(self) -> None:
        """Unsubscribe, then cancel the commands still running and wait for them to end."""
        await unsubscribe_quietly(self._subscriptions, "orchestrator commands")
        self._subscriptions = []
        await cancel_all(self._running)

    async def _on_command(self, msg: Msg) -> None:
        command = self._commands.decode_or_none(msg.data, msg.subject)
        if not msg.reply:
            return
        if command is None:
            await self._answer(msg, CommandOutcome(outcome="refused", reason="malformed command"))
            return
        task = asyncio.create_task(self._run(msg, command), name=f"command:{type(command).__name__}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _on_wake(self, msg: Msg) -> None:
        """The wake subject carries `WakeModel` only (the router may not send other commands)."""
        command = self._commands.decode_or_none(msg.data, msg.subject)
        if command is not None and not isinstance(command, WakeModel):
            command = None
        if msg.reply and command is None:
            await self._answer(msg, CommandOutcome(outcome="refused", reason="not a wake_model command"))
            return
        if command is not None:
            task = asyncio.create_task(self._run(msg, command), name="command:WakeModel")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, msg: Msg, command: OrchestratorCommand) -> None:
        try:
            outcome = await self._execute(command)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("command %r failed", command)
            outcome = CommandOutcome(outcome="failed", reason=f"internal error: {error}")
        log.info("command %s %s: %s %s", type(command).__name__, getattr(command, "worker_id", ""),
                 outcome.outcome, outcome.reason)
        if msg.reply:
            await self._answer(msg, outcome)

    async def _answer(self, msg: Msg, outcome: CommandOutcome) -> None:
        try:
            await self._bus.client.publish(msg.reply, encode(outcome))
        except Exception as error:  # the asker times out
            log.warning("could not answer a command: %s", error)
