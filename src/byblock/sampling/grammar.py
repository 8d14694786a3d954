"""Structured output: a grammar (JSON object, JSON schema, regex or Lark) applied to every target row as a token
mask, through llguidance.

Why llguidance (over xgrammar and outlines-core, all three on PyPI): it installs with no dependencies (xgrammar
requires triton and a torch of its choosing; outlines-core needs a schema → regex step and covers less of JSON
Schema), its Earley parser takes full JSON Schema and Lark grammars, vLLM and SGLang ship it as a backend, and
its matcher rolls back — what speculative verification needs: a drafted node's mask is the grammar's state after
the committed tokens *and the node's own path*, computed by consuming the path, masking, rolling back.

Lossless: verification adjusts each row with its own path's mask (sampling/penalties.py AdjustedRows), so
greedy speculative output equals greedy constrained output, and sampling draws from the constrained law, whatever
the drafter proposed. Drafts are also cut at their first token the grammar refuses (`trim`), which costs nothing
and saves the rows.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from byblock.errors import ByblockError, InvalidParameterError

# JSON as json.dumps writes it. llguidance's default lets any whitespace run between tokens, and a model that
# likes spaces then fills max_tokens with them (vLLM has --guided-decoding-disable-any-whitespace for it); a
# schema's own "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarKind(Enum):
    """What the grammar's source text is."""

    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format {"type": "json_object"})
    JSON_SCHEMA = "json_schema"  # source: a JSON Schema document
    REGEX = "regex"  # Rust regex syntax
    CHOICE = "choice"  # source: a JSON list of strings, exactly one of which is the output
    GRAMMAR = "grammar"  # a Lark grammar, or a GBNF one (llama.cpp's format)


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text (frozen and hashable: it lives in SamplingParams)."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.kind, str):
            object.__setattr__(self, "kind", GrammarKind(self.kind))
        if self.kind is GrammarKind.JSON_SCHEMA:
            try:
                json.loads(self.source)
            except (TypeError, ValueError) as e:
                raise InvalidParameterError(f"the JSON schema is not valid JSON: {e}") from None
        elif self.kind is GrammarKind.CHOICE:
            try:
                ok = isinstance(c := json.loads(self.source), list) and c and all(isinstance(x, str) for x in c)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise InvalidParameterError("a choice grammar needs a non-empty JSON list of strings")
        elif self.kind is not GrammarKind.JSON_OBJECT and not self.source:
            raise InvalidParameterError(f"a {self.kind.value} grammar needs its source")

    @staticmethod
    def json_schema(schema: dict[str, Any] | str) -> Grammar:
        """JSON matching `schema` (a dict or its JSON text)."""
        return Grammar(GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    def check(self) -> None:
        """Raise InvalidParameterError unless llguidance can build this grammar (no tokenizer needed: cheap)."""
        _require()
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(self.llguidance_grammar())
        if problem:
            raise InvalidParameterError(f"the {self.kind.value} grammar is invalid: {problem.splitlines()[0]}")

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own format (InvalidParameterError when it cannot be read)."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.kind is GrammarKind.JSON_OBJECT:
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            if self.kind is GrammarKind.JSON_SCHEMA:
                return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
            return grammar_from(self.kind.value, self.source)
        except ValueError as e:
            raise InvalidParameterError(f"the {self.kind.value} grammar is invalid: {str(e).splitlines()[0]}") from None


def _require() -> None:
    from byblock.extras import require

    require("structured", "structured output (response_format / grammar)")


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer, vocab: int, eos: tuple[int, ...]):
    """llguidance's view of a tokenizer (~1 s to build for a 49k vocabulary: once per model)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos))


class Constraint:
    """One request's grammar state: the matcher advanced over the committed output."""

    def __init__(self, grammar: Grammar, tokenizer, vocab: int, eos: tuple[int, ...], device: torch.device) -> None:
        """tokenizer: the target's (a fast HF tokenizer); vocab: its logits' width; eos: ids the grammar may end on."""
        _require()
        from llguidance import LLMatcher

        try:
            tok = _ll_tokenizer(tokenizer, vocab, tuple(sorted(eos)))
        except ValueError as e:
            raise ByblockError(f"structured output needs a fast tokenizer: {e}") from None
        source = grammar.llguidance_grammar()
        problem = LLMatcher.validate_grammar(source, tok)
        if problem:
            raise InvalidParameterError(f"the {grammar.kind.value} grammar is invalid: {problem.splitlines()[0]}")
        self.matcher = LLMatcher(tok, source, log_level=0)
        self.vocab = vocab
        self.device = device
        self.eos = frozenset(eos)
        self._eos_only = torch.zeros(vocab, dtype=torch.bool, device=device)
        self._eos_only[torch.tensor(sorted(eos), dtype=torch.long, device=device)] = True
        self._bits = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)

    def _allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar accepts next (EOS among them once it may end)."""
        raw = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)  # LSB-first words
        bits = (raw[:, None] & self._bits) != 0  # [bytes, 8]: bit b of byte j is token 8j + b
        return bits.flatten()[: self.vocab].to(self.device)

    def row(self, logits: torch.Tensor, path: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
        """logits [V] of the row after the committed output and `path` -> float32 [V], refused tokens at -inf.

        A walk may read a row past an EOS the grammar ended on (it stops at EOS later, in the output
        processor): such a row allows EOS only, as the ended matcher does in plain decoding."""
        return logits.float().masked_fill(~self.allowed(path), float("-inf"))

    def allowed(self, path: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
        """[V] bool: the tokens the grammar accepts after the committed output and `path` (see row)."""
        m = self.matcher
        consumed = m.try_consume_tokens(list(path)) if path else 0
        ended = False
        if consumed != len(path):
            ended = path[consumed] in self.eos and m.is_accepting()
            if not ended:  # unreachable in a walk: it only reaches nodes whose tokens were allowed
                m.rollback(consumed)
                raise ByblockError("internal error: a verify row past a token the grammar refuses")
        allowed = self._eos_only if ended else self._allowed()
        if consumed:
            m.rollback(consumed)
        return allowed

    def accepts(self, tokens: list[int]) -> bool:
        """Whether the grammar takes all of `tokens` in order from the committed state (an EOS ending it: no,
        so the caller takes the masked path, which knows how the matcher ends)."""
        return not self.eos.intersection(tokens) and self.matcher.validate_tokens(tokens) == len(tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (a drafted chain) the grammar accepts in order from the committed state."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def commit(self, tokens: list[int]) -> None:
        """Advance over emitted tokens (the target chose them under the mask, so the grammar accepts them)."""
        for t in tokens:
            if self.matcher.is_stopped():  # EOS after the grammar ended: nothing more to match
                return
            if not self.matcher.consume_token(t):
                raise ByblockError(f"internal error: the grammar refused an emitted token: {self.matcher.get_error()}")
