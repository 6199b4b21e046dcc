"""Data: prompt sources with epochs and a resumable cursor, problems read from files, their encoding into
``Prompt``s (refusing any that the tokenizer cannot encode without loss), and rewards against a reference
answer."""

from asyncrl.data.encode import encode_prompt, encode_prompts, prompt_text
from asyncrl.data.files import ANSWER_KEYS, PROMPT_KEYS, Example, load_examples, load_rows, split_held_out
from asyncrl.data.rewards import answer_reward, load_reward, reference_answer
from asyncrl.data.source import PromptSource

__all__ = [
    "ANSWER_KEYS", "PROMPT_KEYS", "Example", "PromptSource", "answer_reward", "encode_prompt", "encode_prompts",
    "load_examples", "load_reward", "load_rows", "prompt_text", "reference_answer", "split_held_out",
]
