"""The bundled closed-loop scenarios, and loading a user's own scenario file.

- chat: short questions, short answers, a few seconds of thinking between turns.
- rag: one long system document shared by every request + a short question; exercises
  the prefix cache (TTFT should drop once the document's KV is cached).
- long-prompt: a different long document per request, summarized.
- mixed: the three as user classes weighted 6 : 3 : 1.

A scenario file is a Python file that defines `SCENARIO: tuple[UserClass, ...]`.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from loadtest.request import BenchRequest
from loadtest.users import Task, UserClass, between

WORDS = (
    "the",
    "model",
    "cache",
    "token",
    "request",
    "worker",
    "river",
    "mountain",
    "city",
    "light",
    "music",
    "garden",
    "system",
    "network",
    "energy",
    "market",
    "history",
    "science",
    "water",
    "forest",
    "language",
    "memory",
    "picture",
    "window",
    "engine",
    "signal",
    "planet",
    "ocean",
    "number",
    "theory",
    "paper",
    "friend",
    "school",
    "winter",
    "summer",
    "kitchen",
    "doctor",
    "museum",
    "island",
    "bridge",
    "station",
    "letter",
    "question",
    "answer",
    "reason",
    "moment",
    "country",
)

QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Explain in one sentence why the sky is blue.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Write a haiku about autumn.",
)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


RAG_DOCUMENT = "Answer from this document only.\n" + words(random.Random(1234), 1500)


def chat_request(rng: random.Random) -> BenchRequest:
    question = rng.choice(QUESTIONS)
    return BenchRequest(question, len(question) // 4, 64, label="chat")


def rag_request(rng: random.Random) -> BenchRequest:
    prompt = f"{RAG_DOCUMENT}\n\nQuestion: {rng.choice(QUESTIONS)}"
    return BenchRequest(prompt, 1510, 64, label="rag")


def long_prompt_request(rng: random.Random) -> BenchRequest:
    prompt = f"Summarize this text:\n{words(rng, 2000)}"
    return BenchRequest(prompt, 2005, 128, label="long-prompt")


CHAT = UserClass("chat", (Task("chat", chat_request),), between(1, 3), weight=6)
RAG = UserClass("rag", (Task("rag", rag_request),), between(1, 3), weight=3)
LONG_PROMPT = UserClass(
    "long-prompt", (Task("long-prompt", long_prompt_request),), between(2, 5), weight=1
)

SCENARIOS: dict[str, tuple[UserClass, ...]] = {
    "chat": (CHAT,),
    "rag": (RAG,),
    "long-prompt": (LONG_PROMPT,),
    "mixed": (CHAT, RAG, LONG_PROMPT),
}


def load_scenario(name_or_path: str) -> tuple[UserClass, ...]:
    if name_or_path in SCENARIOS:
        return SCENARIOS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"no scenario {name_or_path!r}: choose from {sorted(SCENARIOS)} "
            "or give a .py file defining SCENARIO"
        )
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.SCENARIO)
