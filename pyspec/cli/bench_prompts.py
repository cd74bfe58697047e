"""The prompt sets ``pyspec bench --prompt-set`` runs: texts of one kind each, so that a draft-length policy
is measured where drafting pays (code, repetitive lists), where it rarely does (prose), and on chat turns.

A set holds text prompts (continued as they are) and :class:`ChatPrompt` s (messages, rendered with the
target model's chat template, or the built-in one of its architecture, when the benchmark starts:
:func:`prompt_inputs`). ``builtin`` is the set ``pyspec bench`` runs without ``--prompt-set``; ``all`` is
every other set in the order of :data:`PROMPT_SETS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ALL", "BUILTIN_PROMPTS", "PROMPT_SETS", "ChatPrompt", "Prompt", "prompt_inputs", "prompt_set"]


@dataclass(frozen=True)
class ChatPrompt:
    """A chat turn to answer: ``messages`` as (role, content) pairs."""

    messages: tuple[tuple[str, str], ...]

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


Prompt = str | ChatPrompt

# continuations with repeated structure, where n-gram drafts have something to find
BUILTIN_PROMPTS: tuple[str, ...] = (
    "class Vector3:\n"
    "    def __init__(self, x, y, z):\n"
    "        self.x = x\n"
    "        self.y = y\n"
    "        self.z = z\n"
    "\n"
    "    def __add__(self, other):\n"
    "        return Vector3(self.x + other.x, self.y + other.y, self.z + other.z)\n"
    "\n"
    "    def __sub__(self, other):\n"
    "        return Vector3(self.x - other.x, self.y - other.y, self.z - other.z)\n"
    "\n"
    "    def __mul__(self, other):\n",
    "The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.\n"
    "The months of the year are January, February, March,",
    "import unittest\n"
    "\n"
    "\n"
    "class TestStringMethods(unittest.TestCase):\n"
    "    def test_upper(self):\n"
    "        self.assertEqual('foo'.upper(), 'FOO')\n"
    "\n"
    "    def test_lower(self):\n"
    "        self.assertEqual('FOO'.lower(), 'foo')\n"
    "\n"
    "    def test_isupper(self):\n",
)

# code in three languages, each partway through a run of similar members
CODE_PROMPTS: tuple[str, ...] = (
    "from dataclasses import dataclass\n"
    "\n"
    "\n"
    "@dataclass\n"
    "class Rect:\n"
    "    left: float\n"
    "    top: float\n"
    "    width: float\n"
    "    height: float\n"
    "\n"
    "    @property\n"
    "    def right(self) -> float:\n"
    "        return self.left + self.width\n"
    "\n"
    "    @property\n"
    "    def bottom(self) -> float:\n"
    "        return self.top + self.height\n"
    "\n"
    "    @property\n",
    "function reducer(state, action) {\n"
    "  switch (action.type) {\n"
    "    case \"increment\":\n"
    "      return { ...state, count: state.count + 1 };\n"
    "    case \"decrement\":\n"
    "      return { ...state, count: state.count - 1 };\n"
    "    case \"double\":\n",
    "CREATE TABLE authors (\n"
    "    id INTEGER PRIMARY KEY,\n"
    "    name TEXT NOT NULL,\n"
    "    born DATE\n"
    ");\n"
    "\n"
    "CREATE TABLE books (\n"
    "    id INTEGER PRIMARY KEY,\n"
    "    author_id INTEGER NOT NULL REFERENCES authors(id),\n"
    "    title TEXT NOT NULL,\n"
    "    published DATE\n"
    ");\n"
    "\n"
    "CREATE TABLE reviews (\n",
)

# free prose: little for an n-gram draft to copy (a policy must not fall below plain decoding here)
PROSE_PROMPTS: tuple[str, ...] = (
    "The lighthouse keeper had lived on the island for eleven years before the first letter arrived. It came",
    "Photosynthesis is the process by which green plants turn light into chemical energy. In the leaves,",
    "When the committee met on Tuesday morning, the first item on the agenda was the budget for the coming "
    "year. The treasurer",
)

# lists and tables whose next lines repeat the last ones' shape
REPETITIVE_PROMPTS: tuple[str, ...] = (
    "7 x 1 = 7\n7 x 2 = 14\n7 x 3 = 21\n7 x 4 = 28\n7 x 5 = 35\n",
    "date,city,temperature\n"
    "2024-01-01,Oslo,-3\n"
    "2024-01-02,Oslo,-5\n"
    "2024-01-03,Oslo,-4\n"
    "2024-01-04,",
    "<ul>\n"
    "  <li><a href=\"/home\">Home</a></li>\n"
    "  <li><a href=\"/about\">About</a></li>\n"
    "  <li><a href=\"/blog\">Blog</a></li>\n"
    "  <li>",
)

# chat turns: one that copies its input, one that reshapes it, one free answer
CHAT_PROMPTS: tuple[ChatPrompt, ...] = (
    ChatPrompt((("user", "Rewrite this sentence in the past tense: \"The train leaves the station at noon, and "
                          "the passengers wave goodbye to their families on the platform.\""),)),
    ChatPrompt((("user", "Turn this list into a JSON array of objects with the keys name and age: Alice 31, "
                         "Bob 27, Carol 45, Dave 38."),)),
    ChatPrompt((("user", "Give me three tips for keeping houseplants healthy."),)),
)

PROMPT_SETS: dict[str, tuple[Prompt, ...]] = {
    "builtin": BUILTIN_PROMPTS,
    "code": CODE_PROMPTS,
    "prose": PROSE_PROMPTS,
    "repetitive": REPETITIVE_PROMPTS,
    "chat": CHAT_PROMPTS,
}
ALL = "all"


def prompt_set(names: str) -> list[Prompt]:
    """The prompts of the sets ``names`` (keys of :data:`PROMPT_SETS`, or ``all``, separated by commas), in that
    order; ValueError naming the known sets."""
    out: list[Prompt] = []
    for name in (n.strip() for n in names.split(",")):
        if name == ALL:
            out += [p for key, ps in PROMPT_SETS.items() if key != "builtin" for p in ps]
        elif name in PROMPT_SETS:
            out += PROMPT_SETS[name]
        else:
            raise ValueError(f"unknown prompt set {name!r} (known: {', '.join([*PROMPT_SETS, ALL])})")
    return out


def prompt_inputs(model: Any, prompts: Sequence[Prompt]) -> tuple[list[str], list[str | list[int]]]:
    """(each prompt's text, what a generation is given for it): a text prompt as it is; a chat prompt
    rendered with ``model``'s template (its text) and tokenized as a chat (special-token text parsed, BOS
    where the template wrote none)."""
    from pyspec.generation.chat import render_chat, tokenize_chat

    texts: list[str] = []
    inputs: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, ChatPrompt):
            text = render_chat(model, p.as_messages())
            texts.append(text)
            inputs.append(tokenize_chat(model.vocab, text))
        else:
            texts.append(p)
            inputs.append(p)
    return texts, inputs
