"""What the suffix drafter's history holds while ``bench`` runs: nothing by default, or earlier
answers.

A benchmark must be fair and repeatable, so it never learns its own answers as it goes (the
plain run of a prompt, learnt before the speculative ones, would hand them the answer). What the
history holds is fixed per prompt instead, the same for every method and every repeat:

- ``--history PATH``: the answers in PATH, learnt once: a conversations database (the app's
  ``chats.db``: its complete answers, newest first up to the history's cap) or a JSONL prompt
  file (every assistant message of its rows, in file order);
- ``--history-session``: the prompts are one user's session, in file order: prompt i runs with
  the plain-decoding answers of prompts 0 .. i-1 (their first repeat) learnt too, as the app
  would have learnt them (``localspec/data/multiturn.jsonl`` is written for this: a question
  asked again, a regenerated answer, a JSON round trip repeated).

Both together: PATH's answers, then the session's.
"""

from __future__ import annotations

from pathlib import Path

from localspec.chats.store import ChatStore
from localspec.config import HISTORY_DRAFT_TOKENS
from localspec.errors import ConfigError
from localspec.pipeline import Pipeline
from localspec.training.prompts import load_prompts

HISTORY_CHARS = 4 * HISTORY_DRAFT_TOKENS  # a database's newest answers read, in characters


def history_texts(path: str) -> list[str]:
    """The answers of ``path``, oldest first: a conversations database (``.db``) or a JSONL
    prompt file's assistant messages; ConfigError if it is neither."""
    if Path(path).suffix == ".db":
        if not Path(path).is_file():
            raise ConfigError(f"--history {path}: no such conversations database")
        with ChatStore(Path(path)) as store:
            return store.answer_texts(HISTORY_CHARS)
    texts = [m["content"] for row in load_prompts(path) for m in row.get("messages", ())
             if m.get("role") == "assistant" and isinstance(m.get("content"), str)
             and m["content"].strip()]
    if not texts:
        raise ConfigError(f"--history {path}: no assistant answers in it (a JSONL prompt file "
                          "whose rows hold assistant messages, or a conversations .db)")
    return texts


class BenchHistory:
    """The history each prompt of a benchmark runs with (see the module docstring)."""

    def __init__(self, pipe: Pipeline, path: str | None, session: bool) -> None:
        if pipe.answer_history() is None:
            raise ConfigError(f"preset '{pipe.preset.name}' turns history drafts off "
                              "([localspec] history_drafts = false): --history has no effect")
        self.pipe, self.session = pipe, session
        texts = history_texts(path) if path is not None else []
        self.base: list[list[int]] = (
            pipe.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        # prompt -> its ids and its plain answer's (session)
        self.answers: dict[int, tuple[list[int], list[int]]] = {}

    def before(self, prompt: int) -> None:
        """Set the history prompt ``prompt`` runs with (its methods and repeats alike)."""
        earlier = [self.answers[i] for i in range(prompt) if i in self.answers and self.session]
        self.pipe.history.replace([*self.base, *(answer for _, answer in earlier)],
                                  [*([()] * len(self.base)), *(ids for ids, _ in earlier)])

    def answered(self, prompt: int, prompt_ids: list[int], token_ids: list[int]) -> None:
        """Prompt ``prompt``'s plain answer (its first): the session's later prompts learn it,
        after the end of its prompt as the app would."""
        self.answers.setdefault(prompt, (list(prompt_ids), list(token_ids)))

    def describe(self) -> str:
        """One line for the report: what the history held."""
        parts = [f"{len(self.base)} answers from the file"] if self.base else []
        if self.session:
            parts.append("each prompt's plain answer for the prompts after it")
        return "history: " + (", ".join(parts) or "empty")
