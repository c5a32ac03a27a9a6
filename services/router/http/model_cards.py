"""What `/v1/models` lists: each model the router serves, with its context length.

A card's `max_model_len` (as vLLM's cards carry it) is the longest context that a worker
able to serve the model registered (`WorkerCapacity.max_model_len`): the limit the
dispatcher holds a request to. With no such worker up, it is the longest any of the
model's workers (a prefill worker) registered, and with none, the model's own limit from
its tokenizer's model directory (`max_position_embeddings`; the router's own model and the
scalable ones are served with no worker up): a worker cannot offer more than its model does.
`/tokenize` answers the same figure.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.http.serving import ServingContext
from services.router.openai.protocol_answers import ModelCard, ModelList
from services.router.routing import WorkerView, context_limit


def max_model_len(context: ServingContext, model: str, views: Sequence[WorkerView] | None = None) -> int:
    """`model`'s context length now; `views`: the pool's, when the caller has them already."""
    views = context.pool.views() if views is None else views
    limit = context_limit(views, model)
    if limit is None:
        limit = max((view.max_model_len for view in views if view.model == model), default=None)
    if limit is not None:
        return limit
    own = context.catalog.default if model == context.catalog.default.name else None
    tokenizer = own.tokenizer if own is not None else context.catalog.tokenizer_loaded(model)
    return (tokenizer or context.catalog.default.tokenizer).max_model_len


def model_list(context: ServingContext) -> ModelList:
    views = context.pool.views()
    return ModelList(data=[ModelCard(id=model, max_model_len=max_model_len(context, model, views))
                           for model in context.models()])
