"""Incremental detokenization and stop strings on plain data (and the real tiny tokenizer)."""

from __future__ import annotations

import pytest

from services.router.flows.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, answer_text
from services.router.flows.stop_strings import StopStringMatcher
from services.router.openai.logprobs import LogprobsRenderer
from shared.schemas import TokenLogprobs


class ByteDecoder:
    """A byte-level vocabulary: each id is a byte string, decoded with replacement."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def byte_tokens(text: str) -> tuple[ByteDecoder, list[int]]:
    """One token per UTF-8 byte, so every multi-byte character is split across tokens."""
    data = text.encode()
    return ByteDecoder({i: bytes([b]) for i, b in enumerate(data)}), list(range(len(data)))


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], per_push: int = 1) -> list[str]:
    deltas = [detokenizer.push(ids[i:i + per_push]) for i in range(0, len(ids), per_push)]
    return [*deltas, detokenizer.finish()]


@pytest.mark.parametrize("per_push", [1, 2, 3])
def test_multibyte_characters_are_never_split(per_push: int) -> None:
    text = "café ☕ 日本語 🚀 done"
    decoder, ids = byte_tokens(text)
    deltas = stream(IncrementalDetokenizer(decoder), ids, per_push)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_context_from_the_prompt_keeps_leading_spaces() -> None:
    # a SentencePiece-like decoder drops the leading space of the first token it decodes
    pieces = {0: "Hello", 1: " world", 2: " again"}

    class StrippingDecoder:
        def decode(self, ids: list[int]) -> str:
            return "".join(pieces[i] for i in ids).removeprefix(" ")

    deltas = stream(IncrementalDetokenizer(StrippingDecoder(), prompt_ids=[0]), [1, 2])
    assert "".join(deltas) == " world again"


def test_an_incomplete_character_at_the_end_is_dropped_as_vllm_drops_it() -> None:
    decoder = ByteDecoder({0: b"ok", 1: "é".encode()[:1]})
    detokenizer = IncrementalDetokenizer(decoder)
    assert detokenizer.push([0]) == "ok"
    assert detokenizer.push([1]) == ""  # held back: may complete later
    assert detokenizer.finish() == ""  # it never did: dropped


def test_real_tokenizer_round_trip(tmp_path_factory: pytest.TempPathFactory) -> None:
    from shared.tiny_model import generate_tiny_model
    from shared.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny") / "model"
    generate_tiny_model(str(path))
    tokenizer = Tokenizer.from_model_dir(str(path))
    text = " The machine hums — naïve café, 東京 and 🚀 rockets."
    prompt = tokenizer.encode("Prompt:")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), tokenizer.encode(text))
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


@pytest.mark.parametrize("per_push", [1, 5])
def test_a_long_output_across_window_restarts_decodes_once_per_step(per_push: int) -> None:
    text = "Ünïcode ☕ and plain words, " * 12  # some 330 byte tokens: the window restarts many times
    decoder, ids = byte_tokens(text)
    calls = 0

    class CountingDecoder:
        def decode(self, window: list[int]) -> str:
            nonlocal calls
            calls += 1
            return decoder.decode(window)

    deltas = stream(IncrementalDetokenizer(CountingDecoder()), ids, per_push)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    steps = -(-len(ids) // per_push)
    assert calls <= steps * 1.25  # one decode a step, and one more at each restart


def test_stop_string_truncates_and_never_shows_part_of_it() -> None:
    matcher = StopStringMatcher(["STOP"])
    shown = [matcher.push(piece) for piece in ["abc S", "T", "O", "P tail"]]
    assert shown == ["abc ", "", "", ""]
    assert matcher.stopped
    assert matcher.push("more") == ""


def test_a_false_start_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("ST") == ""
    assert matcher.push("ART") == "START"
    assert matcher.push("x S") == "x "
    assert matcher.flush() == "S"
    assert not matcher.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["world", "o w"])
    assert matcher.push("hello world") == "hell"
    assert matcher.stopped


def test_stop_string_spanning_pieces_and_at_the_start() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.push("line\n") == "line"
    assert matcher.push("\nnext") == ""
    assert matcher.stopped
    immediate = StopStringMatcher(["x"])
    assert immediate.push("xyz") == "" and immediate.stopped


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher(["", ""])
    assert matcher.push("anything") == "anything"
    assert matcher.flush() == ""


@pytest.mark.parametrize("per_push", [1, 2, 4])
def test_the_answer_ends_at_the_last_complete_character_however_the_tokens_arrive(per_push: int) -> None:
    # "ok" then the first two bytes of a 3-byte character: vLLM shows "ok", per token
    decoder = ByteDecoder({0: b"o", 1: b"k", 2: "日".encode()[:1], 3: "日".encode()[1:2]})
    ids = [0, 1, 2, 3]
    assert "".join(stream(IncrementalDetokenizer(decoder), ids, per_push)) == "ok" == answer_text(decoder, ids)


class SpecialByteDecoder(ByteDecoder):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return super().decode(ids)


def test_logprobs_show_each_tokens_text_completing_split_characters_from_the_sampled_context() -> None:
    # "é" is two bytes, one token each: the first shows "" (incomplete), the second "é"
    first, second = "é".encode()[:1], "é".encode()[1:]
    decoder = SpecialByteDecoder({0: b"a", 1: first, 2: second, 3: b"b"})
    renderer = LogprobsRenderer(decoder, top=1)
    positions = [TokenLogprobs([0, 3], [-0.1, -2.5], [1, 2]), TokenLogprobs([1], [-0.2], [1]),
                 TokenLogprobs([2, 0], [-float("inf"), -0.3], [5, 1])]
    completion = renderer.completion(positions)
    assert completion == {"tokens": ["a", "", "é"], "token_logprobs": [-0.1, -0.2, -9999.0],
                          "top_logprobs": [{"a": -0.1, "b": -2.5}, {"": -0.2}, {"é": -9999.0, "a": -0.3}],
                          "text_offset": [0, 1, 1]}
    chat = LogprobsRenderer(decoder, top=1).chat(positions[:1])
    assert chat == [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.1, "bytes": [97]}]}]


def test_logprobs_name_tokens_by_id_when_asked_as_vllm_names_them() -> None:
    """`return_tokens_as_token_ids`: `token_id:<id>` for every entry (offsets by those names);
    a chat position's own bytes stay its text's, its top entries' are their names'."""
    decoder = SpecialByteDecoder({0: b"a", 3: b"bc"})
    positions = [TokenLogprobs([0, 3], [-0.1, -2.5], [1, 2]), TokenLogprobs([3], [-0.2], [1])]
    completion = LogprobsRenderer(decoder, top=1, as_token_ids=True).completion(positions)
    assert completion == {"tokens": ["token_id:0", "token_id:3"], "token_logprobs": [-0.1, -0.2],
                          "top_logprobs": [{"token_id:0": -0.1, "token_id:3": -2.5}, {"token_id:3": -0.2}],
                          "text_offset": [0, 10]}
    chat = LogprobsRenderer(decoder, top=2, as_token_ids=True).chat(positions[:1])
    assert chat == [{"token": "token_id:0", "logprob": -0.1, "bytes": [97], "top_logprobs": [
        {"token": "token_id:0", "logprob": -0.1, "bytes": list(b"token_id:0")},
        {"token": "token_id:3", "logprob": -2.5, "bytes": list(b"token_id:3")}]}]
    echoed = LogprobsRenderer(decoder, top=1, as_token_ids=True).prompt([3, 0], [None, positions[0]])
    assert echoed["tokens"] == ["token_id:3", "token_id:0"] and echoed["text_offset"] == [0, 10]


def test_a_kept_stop_string_ends_the_output_after_it_with_nothing_held_back() -> None:
    """vLLM's `include_stop_str_in_output`: the output ends after the stop string that completes
    first (on a tie, the first listed), and no text waits for the next piece."""
    matcher = StopStringMatcher(["world", "o w"], include=True)
    assert matcher.push("hello") == "hello" and not matcher.stopped  # nothing held back
    assert matcher.push(" world and more") == " w" and matcher.stopped  # "o w" completes first, across pieces
    kept = StopStringMatcher(["lo", "hel"], include=True)
    assert kept.push("hello") == "hel" and kept.stopped
    tie = StopStringMatcher(["c", "bc"], include=True)
    assert tie.push("abcd") == "abc"  # both complete at "c": the first listed, kept
    assert StopStringMatcher(["c", "bc"]).push("abcd") == "ab"  # left out: the output ends before it


def test_a_stop_string_must_end_after_the_unsearched_text() -> None:
    """The answer's first `min_tokens` tokens are pushed unsearched (vLLM never stops in them):
    a stop string inside them is passed over; one that ends after them is found."""
    matcher = StopStringMatcher(["ab"])
    assert matcher.push("xab", search=False) == "xab" and not matcher.stopped
    assert matcher.push("ya") == "y" and matcher.push("b") == "" and matcher.stopped
    across = StopStringMatcher(["abc"])
    assert across.push("xa", search=False) == "x"  # "a" may begin "abc": held back, as always
    assert across.push("bcz") == "" and across.stopped  # began in it, ends after it: found
    kept = StopStringMatcher(["ab"], include=True)
    assert kept.push("ab", search=False) == "ab" and kept.push("cab") == "cab" and kept.stopped
