"""Built-in tasks with a verifiable reward, for the launcher's embedded RL run.

A task turns a seeded random generator into a prompt and its one correct answer,
and scores a completion against that answer with partial credit per token, so
that a small, freshly initialised model starts with a reward above zero and can
move it. Every task shares one small vocabulary::

    0 PAD   1 BOS   2 SEP   3 EOS   4 .. 4 + num_symbols - 1: the symbols

A prompt is ``BOS s_1 .. s_n SEP`` with ``n`` symbols drawn uniformly; the
answer is the task's transformation of the symbols followed by ``EOS``. Prompt
``i`` of iteration ``it`` comes from its own generator seeded with
``(seed, it, i)``, so the prompts of an iteration do not depend on the
data-parallel layout, and a resumed run sees the same prompts again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4

TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "copy": lambda symbols: symbols,
    "reverse": lambda symbols: symbols[::-1],
    "sort": np.sort,
}
"""What each task asks the model to do with the prompt's symbols."""


@dataclass(frozen=True)
class Prompt:
    """One prompt and the completion that earns the full reward.

    Attributes:
        token_ids: int64 ``[n + 2]``: ``BOS``, the symbols, ``SEP``.
        answer: int64 ``[n + 1]``: the transformed symbols, then ``EOS``.
    """

    token_ids: np.ndarray
    answer: np.ndarray


@dataclass(frozen=True)
class SymbolTask:
    """A sequence-to-sequence task over ``num_symbols`` symbols.

    Args:
        name: One of :data:`TRANSFORMS` (``copy``, ``reverse``, ``sort``).
        num_symbols: Distinct symbols; the vocabulary needs ``FIRST_SYMBOL + num_symbols`` ids.
        min_symbols: Fewest symbols in a prompt.
        max_symbols: Most symbols in a prompt.
    """

    name: str = "reverse"
    num_symbols: int = 8
    min_symbols: int = 3
    max_symbols: int = 6

    def __post_init__(self):
        if self.name not in TRANSFORMS:
            raise ValueError(f"unknown task {self.name!r}; choose one of {sorted(TRANSFORMS)}")
        if self.num_symbols < 2:
            raise ValueError(f"a task needs at least 2 symbols, got {self.num_symbols}")
        if not 1 <= self.min_symbols <= self.max_symbols:
            raise ValueError(f"prompt lengths must satisfy 1 <= min ({self.min_symbols}) <= max ({self.max_symbols})")

    @property
    def vocab_size(self) -> int:
        """The smallest vocabulary that holds the task's tokens."""
        return FIRST_SYMBOL + self.num_symbols

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_symbols + 2

    @property
    def max_answer_tokens(self) -> int:
        """Tokens of the longest correct completion (symbols and ``EOS``)."""
        return self.max_symbols + 1

    def prompt(self, rng: np.random.Generator) -> Prompt:
        """Draws one prompt from ``rng``."""
        n = int(rng.integers(self.min_symbols, self.max_symbols + 1))
        symbols = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + self.num_symbols, n).astype(np.int64)
        tokens = np.concatenate([[BOS], symbols, [SEP]]).astype(np.int64)
        answer = np.concatenate([TRANSFORMS[self.name](symbols), [EOS]]).astype(np.int64)
        return Prompt(tokens, answer)

    def prompts(self, seed: int, iteration: int, indices: Sequence[int]) -> list[Prompt]:
        """Prompts ``indices`` of ``iteration``; each from its own ``(seed, iteration, index)`` generator."""
        return [self.prompt(np.random.default_rng([seed, iteration, int(i)])) for i in indices]

    @staticmethod
    def reward(prompt: Prompt, completion: Sequence[int]) -> float:
        """Fraction of the answer's positions the completion gets right, in [0, 1].

        Position ``j`` of the answer (the ``EOS`` included) earns credit when the
        completion's token ``j`` equals it; a completion that stops early misses the
        rest, one that runs on past the answer has no ``EOS`` where it belongs.
        """
        completion = np.asarray(completion, dtype=np.int64)[: len(prompt.answer)]
        hits = int((completion == prompt.answer[: len(completion)]).sum())
        return hits / len(prompt.answer)
