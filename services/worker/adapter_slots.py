"""Which LoRA adapters a worker holds, in how many slots. `AdapterSlots` is pure and
synchronous; `apply_adapter_message` applies a control message to it, asking the engine first.

The worker's request runner calls `use(adapter)` before each request that names one: a held
adapter is marked most recently used; another is loaded into a free slot, or into the slot of
the least recently used adapter (evicted). `load` and `unload` are the control plane's
(`tandem ctl adapter`, through `apply_adapter_message`). The registration reports `held` and the slot count, which the
router's adapter-aware routing reads (`services.router.routing.adapters`). A worker with no
slots serves no adapter: `use` says so, and the request is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import TandemError
from shared.schemas.control import ControlOutcome, LoadAdapter, UnloadAdapter

if TYPE_CHECKING:
    from services.worker.engine import Engine


@dataclass(frozen=True, slots=True)
class AdapterUse:
    """What `use` did: whether the adapter was held already, and which one it evicted ("": none)."""

    held: bool
    evicted: str = ""


class AdapterSlots:
    def __init__(self, slots: int, loaded: tuple[str, ...] = ()) -> None:
        if slots < len(loaded):
            raise ValueError(f"{len(loaded)} adapters to load at start, but only {slots} adapter slots")
        self.slots = slots
        self._held: OrderedDict[str, None] = OrderedDict.fromkeys(loaded)  # least recently used first

    @property
    def held(self) -> list[str]:
        return sorted(self._held)

    def holds(self, adapter: str) -> bool:
        return adapter in self._held

    def use(self, adapter: str) -> AdapterUse | None:
        """Mark `adapter` used, loading it (and evicting the least recently used one when every
        slot is taken); None when this worker has no slot at all."""
        if adapter in self._held:
            self._held.move_to_end(adapter)
            return AdapterUse(held=True)
        if not self.slots:
            return None
        evicted = ""
        if len(self._held) >= self.slots:
            evicted, _ = self._held.popitem(last=False)
        self._held[adapter] = None
        return AdapterUse(held=False, evicted=evicted)

    def load(self, adapter: str) -> AdapterUse | None:
        return self.use(adapter)

    def unload(self, adapter: str) -> bool:
        """Whether `adapter` was held (and is no longer)."""
        if adapter not in self._held:
            return False
        del self._held[adapter]
        return True


async def apply_adapter_message(message: LoadAdapter | UnloadAdapter, slots: AdapterSlots,
                                engine: Engine) -> tuple[ControlOutcome, str]:
    """A control message's effect on the slots (a load first makes the engine ready to serve
    the adapter: refused when it cannot), with why."""
    if isinstance(message, UnloadAdapter):
        if not slots.unload(message.adapter):
            return "unchanged", f"{message.adapter} is not loaded"
        return "applied", f"{message.adapter} unloaded"
    if not slots.slots:
        return "refused", "this worker has no adapter slots (--max-adapters)"
    try:
        await engine.load_adapter(message.adapter)
    except TandemError as error:
        return "refused", error.message
    use = slots.load(message.adapter)
    assert use is not None  # it has slots
    if use.held:
        return "unchanged", f"{message.adapter} is loaded already"
    return "applied", f"{message.adapter} loaded" + (f" in place of {use.evicted}" if use.evicted else "")
