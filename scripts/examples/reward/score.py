"""The README's worked example: reward completions that write the word "the".

One completion at a time (`score(text) -> float`); a batched reward would take
`(prompts, completions, **fields)` and return a list.
"""


def score(text: str) -> float:
    """How many times "the" appears, over the completion's words (0 to 1)."""
    words = text.lower().split()
    return words.count("the") / max(1, len(words))
