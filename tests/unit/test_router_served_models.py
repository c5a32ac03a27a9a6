"""The router's served models (`services.router.http.served_models`): its own model, and each
model its workers register with that model's own tokenizer (from the registered model
directory); an unknown model is a 404 naming the served ones; a directory the router cannot
read is a 503, never another model's tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.router.http.served_models import ServedModel, ServedModels
from services.router.openai.errors import ModelNotFound
from shared.errors import Unavailable
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import Tokenizer


class RegisteredModels:
    """What `ServedModels` reads of the worker pool: model names and their registered directories."""

    def __init__(self, dirs: dict[str, list[str]], adapters: dict[str, list[str]] | None = None) -> None:
        self.dirs = dirs
        self.adapters = adapters or {}  # model -> the adapters its workers hold

    @property
    def models(self) -> list[str]:
        return sorted(self.dirs)

    def model_dirs(self, model: str) -> list[str]:
        return self.dirs.get(model, [])

    def models_holding(self, adapter: str) -> list[str]:
        return sorted(model for model, adapters in self.adapters.items() if adapter in adapters)


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "small-vocab"
    generate_tiny_model(str(path), vocab_size=1024)
    return str(path)


def catalog(own_dir: str, dirs: dict[str, list[str]]) -> ServedModels:
    return ServedModels(ServedModel("tiny", Tokenizer.from_model_dir(own_dir)), RegisteredModels(dirs))  # type: ignore[arg-type]


def test_each_model_is_tokenized_by_its_own_tokenizer(tiny_model_dir: str, small_vocab_dir: str) -> None:
    models = catalog(tiny_model_dir, {"tiny": [tiny_model_dir], "small": [small_vocab_dir]})
    own, small = asyncio.run(models.resolve("tiny")), asyncio.run(models.resolve("small"))
    assert (own.tokenizer.vocab_size, small.tokenizer.vocab_size) == (2048, 1024)
    text = "The river runs past the mill and under the old stone bridge"
    assert own.tokenizer.encode(text) != small.tokenizer.encode(text)
    assert small.tokenizer.encode(text) == Tokenizer.from_model_dir(small_vocab_dir).encode(text)
    assert models.resolved("small") is small and models.names() == ["small", "tiny"]


def test_an_unknown_model_is_a_404_naming_the_served_ones(tiny_model_dir: str, small_vocab_dir: str) -> None:
    models = catalog(tiny_model_dir, {"small": [small_vocab_dir]})
    with pytest.raises(ModelNotFound) as raised:
        asyncio.run(models.resolve("gpt-4"))
    assert raised.value.http_status == 404
    assert "`gpt-4`" in raised.value.message and "small, tiny" in raised.value.message


def test_an_unreadable_model_directory_is_unavailable(tiny_model_dir: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "elsewhere")
    models = catalog(tiny_model_dir, {"far": [missing]})
    with pytest.raises(Unavailable) as raised:
        asyncio.run(models.resolve("far"))
    assert missing in raised.value.message


def test_workers_that_name_no_directory_get_the_routers_tokenizer(tiny_model_dir: str) -> None:
    models = catalog(tiny_model_dir, {"alias": []})
    assert asyncio.run(models.resolve("alias")).tokenizer is models.default.tokenizer


def test_a_models_tokenizer_loads_once_for_concurrent_requests(tiny_model_dir: str, small_vocab_dir: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    load = Tokenizer.from_model_dir

    def counted(path: str) -> Tokenizer:
        loads.append(path)
        return load(path)

    models = catalog(tiny_model_dir, {"small": [small_vocab_dir]})
    monkeypatch.setattr(Tokenizer, "from_model_dir", counted)

    async def many() -> list[ServedModel]:
        return await asyncio.gather(*(models.resolve("small") for _ in range(5)))

    first = asyncio.run(many())
    again = asyncio.run(models.resolve("small"))  # another event loop: the loaded tokenizer is kept
    assert loads == [small_vocab_dir]
    assert {id(served.tokenizer) for served in [*first, again]} == {id(again.tokenizer)}


def test_a_directory_that_fails_is_tried_again(tiny_model_dir: str, small_vocab_dir: str, tmp_path: Path) -> None:
    later = tmp_path / "later"
    models = catalog(tiny_model_dir, {"later": [str(later)]})
    with pytest.raises(Unavailable):
        asyncio.run(models.resolve("later"))
    generate_tiny_model(str(later), vocab_size=1024)  # the directory appears (a mount, a copy finished)
    assert asyncio.run(models.resolve("later")).tokenizer.vocab_size == 1024


def test_a_scalable_model_is_served_with_no_worker_from_its_configured_directory(tiny_model_dir: str,
                                                                                 small_vocab_dir: str) -> None:
    models = ServedModels(ServedModel("tiny", Tokenizer.from_model_dir(tiny_model_dir)), RegisteredModels({}),  # type: ignore[arg-type]
                          {"small": small_vocab_dir})
    assert models.names() == ["small", "tiny"]
    assert models.tokenizer_loaded("small") is None

    async def loaded() -> ServedModel:
        models.load_scalable()
        return await models.resolve("small")

    served = asyncio.run(loaded())
    assert served.tokenizer.vocab_size == 1024 and models.tokenizer_loaded("small") is served.tokenizer
    with pytest.raises(ModelNotFound):
        asyncio.run(models.resolve("other"))
