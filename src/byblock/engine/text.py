"""Token ids -> text deltas: incremental detokenization and stop strings.

Text already streamed is never taken back: a suffix that could still grow into a stop string is held
until it cannot, so the streamed text always equals the final text.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decode a growing token list into text deltas without re-decoding everything each step.

    Keeps a small window (prefix_offset..read_offset) of context tokens, as in vLLM/TGI, so tokenizers that
    merge across token boundaries (byte-level BPE, sentencepiece leading spaces) decode correctly.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], context: int = 5) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (empty while a UTF-8 sequence is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


def _first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """Start of the stop string that *ends* first in text[start:] (the longest on a tie), or -1.

    Ordering by end, not start, makes the cut independent of how the text was split into deltas: a stop
    that completes earlier ends generation before a longer one that began earlier could complete (a
    speculative round commits several tokens at once and must cut where token-by-token decoding would).
    """
    best_end, best_start = -1, -1
    for s in stops:
        i = text.find(s, start)
        if i < 0:
            continue
        end = i + len(s)
        if best_end < 0 or end < best_end or (end == best_end and i < best_start):
            best_end, best_start = end, i
    return best_start


class StopStringMatcher:
    """Accumulate text; report when a stop string appears; release only text that is safe to show."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""  # everything decoded so far (up to a stop, once found)
        self.released = 0  # chars of self.text already handed out
        self.stopped = False

    def _held_back(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, delta: str) -> str:
        """Add decoded text; return what may be released now. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        cut = _first_stop(self.text, self.stops, start)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        out = self.text[self.released : end]
        self.released = max(self.released, end)
        return out

    def flush(self) -> str:
        """At the end of generation, release whatever was held back."""
        out = self.text[self.released :]
        self.released = len(self.text)
        return out
