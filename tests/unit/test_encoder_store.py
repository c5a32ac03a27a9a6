"""`connector.encoder_store`: entries written whole, namespaced per model, evicted least
recently used past the budget but never within the grace after a use."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.encoder_store import EncoderStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def write_bytes(size: int):
    def save(path: str) -> None:
        Path(path).write_bytes(b"x" * size)
    return save


def test_an_entry_written_is_found_whole_and_another_model_does_not_see_it(tmp_path: Path) -> None:
    store = EncoderStore(str(tmp_path), "vision@1", budget_bytes=1 << 20)
    assert not store.has("abc")
    store.write("abc", write_bytes(10))
    assert store.has("abc") and store.path("abc").read_bytes() == b"x" * 10
    assert not EncoderStore(str(tmp_path), "vision@2", budget_bytes=1 << 20).has("abc")
    assert [p.name for p in store.folder.iterdir()] == ["abc.entry"]  # no temporary file left


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    store = EncoderStore(str(tmp_path), "vision", budget_bytes=1 << 20)

    def broken(path: str) -> None:
        Path(path).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.write("abc", broken)
    assert not store.has("abc") and list(store.folder.iterdir()) == []


def test_the_least_recently_used_go_past_the_budget_but_not_within_the_grace(tmp_path: Path) -> None:
    clock = Clock()
    store = EncoderStore(str(tmp_path), "vision", budget_bytes=250, grace_s=60, clock=clock)

    def held() -> set[str]:  # without marking a use, as `has` does
        return {path.name.removesuffix(".entry") for path in store.folder.iterdir()}

    for key in ("a", "b", "c"):  # written 100 s apart: a at t0, b at t0+100, c at t0+200
        store.write(key, write_bytes(100))
        clock.now += 100
    # c's write made 300 bytes: a, used last at t0, was past its grace and went
    assert held() == {"b", "c"}
    assert store.has("b")  # b used at t0+300: c is the least recently used now
    store.write("d", write_bytes(100))
    assert held() == {"b", "d"}
    clock.now += 1  # every entry within its grace: over budget for now, nothing goes
    store.write("e", write_bytes(100))
    assert held() == {"b", "d", "e"}
    clock.now += 120  # past the grace: the oldest go down to the budget
    assert store.evict() == ["b.entry"] and held() == {"d", "e"}


def test_keys_that_are_not_plain_file_names_are_hashed(tmp_path: Path) -> None:
    store = EncoderStore(str(tmp_path), "../escape", budget_bytes=1 << 20)
    assert store.folder.parent == tmp_path
    store.write("../../etc/passwd", write_bytes(1))
    assert store.path("../../etc/passwd").parent == store.folder
    assert store.has("../../etc/passwd")


def test_a_budget_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="budget"):
        EncoderStore(str(tmp_path), "vision", budget_bytes=0)


def test_a_workers_encoder_cache_flags_give_a_store_per_model_and_version(tmp_path: Path) -> None:
    from services.worker.vllm.config import VllmEngineConfig
    from services.worker.vllm.options import VllmEngineOptions
    from shared.config import ConfigError, WorkerConfig

    (tmp_path / "config.json").write_text("{}")
    plain = WorkerConfig(worker_id="w", engine="vllm", model_dir=str(tmp_path))
    assert VllmEngineOptions.from_worker_config(plain).encoder_cache is None
    config = WorkerConfig(worker_id="w", engine="vllm", model_dir=str(tmp_path), served_model_name="vision",
                          model_version="2")
    cached = VllmEngineConfig(encoder_cache_dir="/cache", encoder_cache_gib=0.5)
    settings = VllmEngineOptions.from_worker_config(config, cached).encoder_cache
    assert settings is not None
    assert (settings.root, settings.namespace, settings.budget_bytes) == ("/cache", "vision@2", 1 << 29)
    with pytest.raises(ConfigError, match="encoder cache size"):
        VllmEngineConfig(encoder_cache_gib=0).validate()
