"""Prompts for parity tests: different lengths (1 to ~20 tokens), text from the tokenizer's corpus."""

PARITY_PROMPTS = [
    "The capital of France is",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "A looped",
    "def add(a, b):",
    "Memory bandwidth limits the speed of decoding when the batch is small",
    "x",
    "The river flows to the sea, the sea meets the sky, and the sky holds",
    "Numbers: 0 1 2 3 4 5",
]
