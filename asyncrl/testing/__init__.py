"""Fixtures for tests, demos and first tries, kept out of the library's own surface: a tiny Qwen2 model and
tokenizer built locally (``tiny``) and a task with an exact reward (``tasks.arithmetic``).

    from asyncrl.testing import arithmetic, build_tiny

    model_dir = build_tiny("models/tiny", arithmetic.corpus())  # loads in transformers and vLLM
"""

from asyncrl.testing.tasks import arithmetic
from asyncrl.testing.tiny import SPECIAL_TOKENS, TinyModelSpec, build_model, build_tiny, build_tokenizer

__all__ = ["SPECIAL_TOKENS", "TinyModelSpec", "arithmetic", "build_model", "build_tiny", "build_tokenizer"]
