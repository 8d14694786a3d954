"""The passkey probe: deterministic prompts of the asked length with the key where it was asked."""

from __future__ import annotations

from tiny import make_tokenizer

from byblock.bench.passkey import correct, make_prompt


def test_prompts_hide_the_key_at_the_depth_and_length():
    tok = make_tokenizer()
    for keys in (1, 3):
        a = make_prompt(tok, 600, 0.25, keys)
        assert a == make_prompt(tok, 600, 0.25, keys)  # deterministic
        n = len(tok(a.text, add_special_tokens=False)["input_ids"])
        assert 0.7 * 600 < n < 1.3 * 600
        where = a.text.index(a.answer) / len(a.text)
        assert 0.1 < where < 0.45
        assert correct(a, f" {a.answer}.") and not correct(a, " 12")
    multi = make_prompt(tok, 600, 0.9, 3)
    assert multi.text.count("The pass key") == 3 and "What is the pass key" in multi.text
