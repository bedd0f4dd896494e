"""The publisher's pure core: incremental detokenisation, stop buffering, EOS and
``max_tokens``. Covers ACCT-16 (held-back text is not visible), VER-28 (stop buffering)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from actors.text_stream import IncrementalDetokenizer, OutputStream, StopStringBuffer

EOS = 256


def byte_decode(ids: Sequence[int]) -> str:
    """A byte-level 'tokenizer': each id is one byte (like byte-level BPE's worst case)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def test_multibyte_character_is_held_until_complete() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    ids = byte_ids("a€b")  # € is three bytes
    released = [detok.push([i]) for i in ids]
    assert released == ["a", "", "", "€", "b"]
    assert all("\ufffd" not in r for r in released)


def test_detokenizer_output_concatenates_to_full_decode() -> None:
    text = "héllo wörld 日本語 🙂 done"
    detok = IncrementalDetokenizer(byte_decode)
    ids = byte_ids(text)
    out = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert out == text


def test_flush_releases_incomplete_tail_as_replacement() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.push(byte_ids("x") + byte_ids("€")[:2]) == "x"
    assert detok.flush() == "\ufffd"


def test_stop_buffer_holds_only_possible_prefixes() -> None:
    buf = StopStringBuffer(["STOP"])
    assert buf.push("abc S") == ("abc ", False)
    assert buf.held_back == "S"
    assert buf.push("T") == ("", False)
    assert buf.push("x") == ("STx", False)  # can no longer become STOP
    assert buf.held_back == ""


def test_stop_buffer_cuts_at_earliest_match() -> None:
    buf = StopStringBuffer(["world", "lo w"])
    assert buf.push("hello world!") == ("hel", True)


def test_stop_buffer_without_stops_passes_everything() -> None:
    buf = StopStringBuffer([])
    assert buf.push("anything") == ("anything", False)


def make_stream(**kw: object) -> OutputStream:
    args: dict[str, object] = {"decode": byte_decode, "max_tokens": 100,
                               "eos_token_ids": (EOS,), "stop": (), "ignore_eos": False}
    args.update(kw)
    return OutputStream(**args)  # type: ignore[arg-type]


def test_acct_16_stop_prefix_postpones_visible_output() -> None:
    """Covers ACCT-16: held back text produces no delta (no delivery) for that fence."""
    stream = make_stream(stop=("\n\n",))
    first = stream.push(byte_ids("hi"))
    assert first.delta is not None and first.delta.text == "hi"
    held = stream.push(byte_ids("\n"))
    assert held.delta is None and held.finish is None
    released = stream.push(byte_ids("x"))
    assert released.delta is not None and released.delta.text == "\nx"
    assert released.delta.token_ids == (10, ord("x"))


def test_stop_string_finishes_with_stop_and_hides_it() -> None:
    stream = make_stream(stop=("END",))
    step = stream.push(byte_ids("abcENDxyz"))
    assert step.finish == "stop"
    assert step.delta is not None and step.delta.text == "abc"
    assert stream.completion_tokens == 9
    assert stream.push(byte_ids("more")).delta is None


def test_eos_finishes_with_stop_and_is_not_shown() -> None:
    stream = make_stream()
    step = stream.push([*byte_ids("ok"), EOS, *byte_ids("zz")])
    assert step.finish == "stop"
    assert step.delta is not None
    assert step.delta.text == "ok" and step.delta.token_ids == tuple(byte_ids("ok"))
    assert stream.completion_tokens == 3


def test_ignore_eos_keeps_generating() -> None:
    stream = make_stream(ignore_eos=True)
    step = stream.push([*byte_ids("a"), EOS, *byte_ids("b")])
    assert step.finish is None
    assert step.delta is not None and step.delta.text == "ab"


def test_max_tokens_finishes_with_length_and_flushes_held_text() -> None:
    stream = make_stream(max_tokens=3, stop=("xyz",))
    step = stream.push(byte_ids("abxy"))
    assert step.finish == "length"
    assert stream.completion_tokens == 3
    assert step.delta is not None and step.delta.text == "abx"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stream_is_chunking_invariant(chunk: int) -> None:
    text = "naïve café — résumé STOP tail"
    stream = make_stream(stop=("STOP",))
    ids = byte_ids(text)
    out = []
    for i in range(0, len(ids), chunk):
        step = stream.push(ids[i:i + chunk])
        if step.delta:
            out.append(step.delta.text)
        if step.finish:
            break
    assert "".join(out) == "naïve café — résumé "
    assert stream.finish_reason == "stop"


def test_stop_token_ids_end_the_output_like_eos() -> None:
    """A request's ``stop_token_ids`` finish it with "stop", the token neither shown nor
    in the delta's ids but counted; they stop it even with ``ignore_eos``."""
    stop = byte_ids("!")[0]
    for ignore_eos in (False, True):
        stream = make_stream(stop_token_ids=(stop,), ignore_eos=ignore_eos)
        step = stream.push([*byte_ids("hey"), stop, *byte_ids("more")])
        assert step.finish == "stop" and step.delta is not None
        assert (step.delta.text, step.delta.token_ids) == ("hey", tuple(byte_ids("hey")))
        assert stream.completion_tokens == 4
    ignored = make_stream(ignore_eos=True)
    assert ignored.push([*byte_ids("a"), EOS, *byte_ids("b")]).finish is None


def test_stop_strings_count_from_the_min_tokens_th_token() -> None:
    """As in vLLM, a stop string in the text of tokens before ``min_tokens`` does not
    end the output; one completed from the ``min_tokens``-th token on does, even when
    it began earlier, and within one fence the boundary falls between its tokens."""
    stream = make_stream(stop=("ab",), min_tokens=4)
    step = stream.push(byte_ids("abxa"))  # "ab" ends at token 2: ignored
    assert step.finish is None and step.delta is not None
    assert step.delta.text == "abx"  # the last "a" may still become "ab"
    step = stream.push(byte_ids("bz"))  # "ab" spanning tokens 4 and 5: stops
    assert step.finish == "stop" and (step.delta is None or step.delta.text == "")
    whole = make_stream(stop=("ab",), min_tokens=4)
    one = whole.push(byte_ids("abxaby"))
    assert one.finish == "stop" and one.delta is not None and one.delta.text == "abx"
    assert make_stream(stop=("ab",)).push(byte_ids("abx")).finish == "stop"
