"""The models the router serves, each with its own tokenizer and chat template.

The router's own model (`RouterConfig.model_dir`, named `--served-model-name` or after its directory)
is always served, with the tokenizer loaded at start. Every other model is one its workers
register: its tokenizer comes from the model directory in their registrations
(`WorkerRegistration.model_dir`), loaded in a thread the first time a request names the
model and kept. A model whose workers name no directory (workers from before the field) is
tokenized with the router's own tokenizer, as a router of one model always did; a directory
the router cannot read is an explicit 503 naming it, never a prompt tokenized by another
model's tokenizer. A scalable model (`--scalable-model NAME=DIR`) is served with no worker up, with the
tokenizer of its configured directory until workers register one. Any other model no worker
registers and that is not the router's own is a 404 naming the served ones (`ModelNotFound`).

A LoRA adapter of a served model is asked for as `"<model>:<adapter>"`: the request is the
base model's (its tokenizer, its workers), served with the adapter (`ServedModel.adapter`).
A served model whose own name holds a colon is that model, never a base and an adapter. An
adapter may also be asked for by its own name, when workers of exactly one model hold an
adapter of that name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from services.router.fleet.worker_pool import WorkerPool
from services.router.openai.errors import ModelNotFound
from shared.errors import Unavailable
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # as clients ask for it
    tokenizer: Tokenizer  # its tokenizer and chat template
    adapter: str = ""  # the LoRA adapter a request asked for ("": the base model)


def split_adapter(model: str) -> tuple[str, str]:
    """`"<model>:<adapter>"` as (model, adapter); a name without a colon is (name, "")."""
    base, colon, adapter = model.rpartition(":")
    return (base, adapter) if colon and base and adapter else (model, "")


class ServedModels:
    def __init__(self, default: ServedModel, pool: WorkerPool, scalable: Mapping[str, str] | None = None) -> None:
        self.default = default
        self._pool = pool
        self._scalable = dict(scalable or {})  # models that may have no worker -> their directories
        self._tokenizers: dict[str, Tokenizer] = {}  # by model directory, once loaded
        self._loading: dict[str, asyncio.Future[Tokenizer]] = {}  # by model directory, while it loads
        self._resolved: dict[str, ServedModel] = {default.name: default}

    def load_scalable(self) -> None:
        """Start loading the scalable models' tokenizers (in threads), so that /v1/models shows
        their context length and their first requests need not wait for them; a directory that
        fails is logged here and tried again by the first request."""
        for model, directory in self._scalable.items():
            load = asyncio.ensure_future(self._load(directory))
            load.add_done_callback(lambda done, model=model: done.cancelled() or done.exception() is None or
                                   log.warning("scalable model %s: %s", model, done.exception()))

    def tokenizer_loaded(self, model: str) -> Tokenizer | None:
        """`model`'s tokenizer if it is loaded, by its workers' directories or its configured one."""
        directories = self._pool.model_dirs(model) or ([self._scalable[model]] if model in self._scalable else [])
        return next((self._tokenizers[d] for d in directories if d in self._tokenizers), None)

    def names(self) -> list[str]:
        return sorted({self.default.name, *self._pool.models, *self._scalable})

    def is_served(self, model: str) -> bool:
        return model == self.default.name or model in self._pool.models or model in self._scalable

    async def resolve(self, model: str) -> ServedModel:
        """`model` with its tokenizer (and adapter, for `"<model>:<adapter>"`); raises
        `ModelNotFound` (404) or `Unavailable` (503)."""
        base, adapter = split_adapter(model)
        if adapter and not self.is_served(model) and self.is_served(base):
            return dataclasses.replace(await self._resolve_base(base), adapter=adapter)
        holders = [] if self.is_served(model) else self._pool.models_holding(model)
        if len(holders) == 1:  # the adapter's own name
            return dataclasses.replace(await self._resolve_base(holders[0]), adapter=model)
        return await self._resolve_base(model)

    async def _resolve_base(self, model: str) -> ServedModel:
        if model == self.default.name:
            return self.default
        if model not in self._pool.models and model not in self._scalable:
            raise ModelNotFound(model, self.names())
        directories = self._pool.model_dirs(model)
        if not directories and model in self._scalable:  # no worker yet: the configured directory
            directories = [self._scalable[model]]
        if not directories:
            served = ServedModel(model, self.default.tokenizer)
        else:
            served = ServedModel(model, await self._tokenizer(model, directories))
        self._resolved[model] = served
        return served

    def resolved(self, model: str) -> ServedModel:
        """A model `resolve` answered (its latest answer): for what a request needs after routing."""
        return self._resolved[model]

    async def _tokenizer(self, model: str, directories: list[str]) -> Tokenizer:
        """The first of `directories` whose tokenizer loads."""
        failures = []
        for directory in directories:
            try:
                return await self._load(directory)
            except Exception as error:  # missing, incomplete or corrupt: named in the 503
                failures.append(f"{directory}: {error}")
        log.warning("no tokenizer for model %s: %s", model, "; ".join(failures))
        raise Unavailable(f"the router cannot read the tokenizer of model {model!r} from the model directory its "
                          f"workers registered ({'; '.join(failures)})")

    async def _load(self, directory: str) -> Tokenizer:
        """The directory's tokenizer, loaded once in a thread (requests arriving meanwhile wait
        for that load; a failed load is tried again by the next request)."""
        tokenizer = self._tokenizers.get(directory)
        if tokenizer is not None:
            return tokenizer
        load = self._loading.get(directory)
        if load is None:
            load = self._loading[directory] = asyncio.ensure_future(
                asyncio.to_thread(Tokenizer.from_model_dir, directory))
            load.add_done_callback(lambda done: self._loaded(directory, done))
        return await asyncio.shield(load)  # a request cancelled meanwhile leaves the load to the others

    def _loaded(self, directory: str, load: asyncio.Future[Tokenizer]) -> None:
        if self._loading.get(directory) is load:
            del self._loading[directory]
        if not load.cancelled() and load.exception() is None:
            self._tokenizers[directory] = load.result()
