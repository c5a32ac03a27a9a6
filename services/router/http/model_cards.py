"""What `/v1/models` lists: each model the router serves, with its context length.

A card's `max_model_len` (as vLLM's cards carry it) is the longest context that a worker
able to serve the model registered (`WorkerCapacity.max_model_len`): the limit the
dispatcher holds a request to. With no such worker up, it is the model's own limit from
the router's model directory (`max_position_embeddings`): the router tokenizes every model
with that one tokenizer, and a worker cannot offer more than its model does.
`/tokenize` answers the same figure.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.http.serving import ServingContext
from services.router.openai.protocol import ModelCard, ModelList
from services.router.routing import WorkerView, context_limit


def max_model_len(context: ServingContext, model: str, views: Sequence[WorkerView] | None = None) -> int:
    """`model`'s context length now; `views`: the pool's, when the caller has them already."""
    limit = context_limit(context.pool.views() if views is None else views, model)
    return context.tokenizer.max_model_len if limit is None else limit


def model_list(context: ServingContext) -> ModelList:
    views = context.pool.views()
    return ModelList(data=[ModelCard(id=model, max_model_len=max_model_len(context, model, views))
                           for model in context.models()])
