"""Digit addition: the synthetic task the demo model learns, its tokenizer and its reward.

A prompt is "a+b=" with a and b drawn from [0, 100), and the answer is the decimal sum followed by
EOS. The tokenizer is character-level: pad, eos, the ten digits, '+' and '='. It is a real
`PreTrainedTokenizerFast`, saved with the checkpoint, so the demo model loads like any HF
checkpoint. The reward is 1.0 for an exactly correct answer and 0.0 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from routereplay.engines.hf import SamplingParams

PAD, EOS = "<pad>", "<eos>"
CHARACTERS = "0123456789+="
VOCAB = [PAD, EOS, *CHARACTERS]


def build_tokenizer() -> Any:
    """A character-level `PreTrainedTokenizerFast` over pad, eos, digits, '+', '='."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(VOCAB)}, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS)


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str  # "17+25="
    answer: str  # "42"


class AdditionTask:
    """Problems a+b= with a, b in [0, limit); reward 1 for the exact sum then EOS."""

    def __init__(self, tokenizer: Any, limit: int = 100) -> None:
        self.tokenizer, self.limit = tokenizer, limit
        self.eos_token_id: int = tokenizer.eos_token_id
        self.pad_token_id: int = tokenizer.pad_token_id

    def problems(self, count: int, seed: int) -> list[Problem]:
        rng = np.random.default_rng(seed)
        pairs = rng.integers(0, self.limit, size=(count, 2))
        return [Problem(f"{a}+{b}=", str(a + b)) for a, b in pairs.tolist()]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, problems: list[Problem]) -> list[list[int]]:
        return [self.encode(p.prompt) for p in problems]

    def target_ids(self, problem: Problem) -> list[int]:
        return [*self.encode(problem.prompt + problem.answer), self.eos_token_id]

    def sampling(
        self, *, max_new_tokens: int, seed: int, temperature: float = 1.0, top_p: float = 1.0
    ) -> SamplingParams:
        """How an engine samples answers to this task's prompts: stopping at its EOS, padding with its pad id."""
        from routereplay.engines.hf import SamplingParams

        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )

    def reward(self, problem: Problem, response_ids: list[int]) -> float:
        if not response_ids or response_ids[-1] != self.eos_token_id:
            return 0.0
        text = self.tokenizer.decode(response_ids[:-1], skip_special_tokens=True).replace(" ", "")
        return 1.0 if text == problem.answer else 0.0


__all__ = ["AdditionTask", "Problem", "build_tokenizer"]
