"""Incremental detokenization and stop strings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import make_tokenizer

from byblock.engine.text import IncrementalDetokenizer, StopStringMatcher

TOK = make_tokenizer()


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="abc xyz\n()é€😀", max_size=40))
def test_incremental_decode_equals_full_decode(text):
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(TOK, prompt_ids=[])
    streamed = "".join(detok.add(i) for i in ids)
    assert streamed == TOK.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet="ab\n", max_size=4), max_size=12),
    st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=2),
)
def test_stop_strings_stream_equals_final(deltas, stops):
    m = StopStringMatcher(tuple(stops))
    out = ""
    for d in deltas:
        out += m.push(d)
        if m.stopped:
            break
    out += m.flush()
    full = "".join(deltas)
    ends = [(i + len(s), i) for s in stops if (i := full.find(s)) >= 0]
    expected = full[: min(ends)[1]] if ends else full
    assert out == m.text == expected
    # The cut does not depend on how the text was split: one character at a time gives the same text.
    one = StopStringMatcher(tuple(stops))
    for ch in full:
        one.push(ch)
    one.flush()
    assert one.text == expected


def test_stop_string_that_ends_first_wins():
    """'a' completes before '\nab' can: generation stops there, however the deltas were split."""
    for deltas in (["\na", "b"], ["\nab"], ["\n", "a", "b"]):
        m = StopStringMatcher(("\nab", "a"))
        out = "".join(m.push(d) for d in deltas) + m.flush()
        assert out == m.text == "\n"
