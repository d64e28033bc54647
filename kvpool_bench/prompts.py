"""The correctness prompts: chat questions, raw text and code, long contexts (the engine's
correctness tests and `scripts/device_check.sh` compare greedy outputs on them)."""
from __future__ import annotations

PARAGRAPH = ("The history of computing is a story of layers: vacuum tubes gave way to transistors, transistors to "
             "integrated circuits, and each layer hid the one below it behind a simpler interface. ")

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Count from 1 to 10.",
    "Explain what a hash table is in two sentences.", "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):", "List three prime numbers greater than 100.", "Who wrote Pride and Prejudice?",
    "Summarize the plot of Romeo and Juliet.", "What is 17 times 23?", "Give me a recipe for pancakes.",
    "¿Cuál es el río más largo del mundo?", "Write a SQL query that counts rows in a table named users.",
    "Why is the sky blue?", "Name the planets of the solar system in order.",
]


def varied_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    """At least 20 prompts: chat questions, raw text and code, and long contexts up to ~1,000 tokens."""
    chat = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    raw = [tokenizer.encode(t) for t in ("Once upon a time", "import numpy as np\n\nx =", "1, 2, 3, 5, 8, 13,")]
    long = []
    for n in (5, 12, 24):
        text = "".join(f"Fact {i}: {PARAGRAPH}" for i in range(n)) + "\nQuestion: what gave way to transistors?"
        long.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    prompts = chat + raw + long
    assert len(prompts) >= 20 and max(len(p) for p in prompts) <= 1000
    return prompts
