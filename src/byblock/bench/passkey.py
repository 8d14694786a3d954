"""Long-context retrieval probes byblock builds itself: a passkey (or several) hidden in filler text.

Each prompt hides `keys` random 5-digit numbers at given depths of a filler of ~`tokens` tokens and asks for
one of them; the answer counts when the generated text contains the asked number. Deterministic per seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "The river flows to the sea. Birds sing in the morning. "
)


@dataclass(frozen=True)
class PasskeyPrompt:
    """One retrieval question."""

    text: str
    answer: str
    depth: float  # where the asked key sits, 0 (start) .. 1 (end)
    length: int  # target prompt length in tokens


def make_prompt(tokenizer, length: int, depth: float, keys: int = 1, seed: int = 0) -> PasskeyPrompt:
    """A filler of about `length` tokens with `keys` pass keys; the asked one sits at `depth`."""
    rng = random.Random(f"{seed}:{length}:{depth}:{keys}")
    values = [str(rng.randint(10000, 99999)) for _ in range(keys)]
    names = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"][:keys]
    per = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    n_fill = max(1, (length - 60) // per)
    chunks = [FILLER] * n_fill
    asked = rng.randrange(keys)
    slots = sorted(rng.sample(range(n_fill + 1), keys - 1)) if keys > 1 else []
    inserts = {int(depth * n_fill): asked}
    others = [i for i in range(keys) if i != asked]
    for slot, k in zip(slots, others, strict=False):
        inserts.setdefault(slot, k)
    body = []
    for i in range(n_fill + 1):
        if i in inserts:
            k = inserts[i]
            label = f"The pass key {names[k]} is {values[k]}. Remember it. " if keys > 1 else ""
            body.append(label or f"The pass key is {values[k]}. Remember it. {values[k]} is the pass key. ")
        if i < n_fill:
            body.append(chunks[i])
    question = f"What is the pass key {names[asked]}?" if keys > 1 else "What is the pass key?"
    text = (
        "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
        + "".join(body)
        + f"\n{question} The pass key is"
    )
    return PasskeyPrompt(text, values[asked], depth, length)


def correct(prompt: PasskeyPrompt, generated: str) -> bool:
    """The asked number appears in the answer."""
    return prompt.answer in generated
