"""Build tiny Qwen2-shaped models and BPE tokenizers locally (no hub access anywhere).

Used by tests, the demo and benchmarks, and by anyone trying asyncrl without a model at hand. The models load in
both transformers and vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
EOS = "</s>"


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of a locally built Qwen2 model."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head size = hidden_size / heads; vLLM CPU wants 32, 64, 80, 96, 112, 128...
    num_key_value_heads: int = 2
    vocab_size: int = 128  # padded above the tokenizer's own vocabulary
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    dtype: str = "float32"
    seed: int = 0


def build_tokenizer(corpus: Iterable[str], out_dir: str | Path, vocab_size: int = 96,
                    added_tokens: Sequence[str] = ()) -> int:
    """Train a byte-level BPE on ``corpus`` and save it as a transformers fast tokenizer.

    ``added_tokens`` become single tokens that decode as their text (as a chat model's ``<tool_call>``).
    Returns the tokenizer's vocabulary size.

    It knows only the corpus's characters, and encodes any other as ``<unk>``. Loaded from a model directory
    (``build_model`` writes a Qwen2 config beside it), transformers 5 rebuilds it as its ``Qwen2Tokenizer``,
    which has no unknown token and drops such characters instead; nothing saved here can change that without
    a byte alphabet, which would grow the vocabulary. ``asyncrl.data.encode_prompts`` refuses both.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=sorted(set("".join(corpus_sample(corpus)))), show_progress=False,
    )
    tok.train_from_iterator(corpus_sample(corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token=EOS, pad_token="<pad>",
    )
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    fast.save_pretrained(str(out_dir))
    return len(fast)


def corpus_sample(corpus: Iterable[str]) -> list[str]:
    return list(corpus)


def build_model(out_dir: str | Path, spec: TinyModelSpec, tokenizer_vocab: int) -> Path:
    """Save a randomly initialised Qwen2 model next to the tokenizer already in ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if spec.vocab_size < tokenizer_vocab:
        raise ValueError(f"TinyModelSpec.vocab_size={spec.vocab_size} < tokenizer vocabulary {tokenizer_vocab}")
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    cfg = Qwen2Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, spec.dtype))
    model.save_pretrained(str(out_dir))
    (Path(out_dir) / "asyncrl_spec.json").write_text(json.dumps(asdict(spec)))
    return Path(out_dir)


def build_tiny(out_dir: str | Path, corpus: Iterable[str], spec: TinyModelSpec | None = None,
               tokenizer_vocab: int = 96) -> Path:
    """Tokenizer + random model in ``out_dir`` (skipped if a model with the same spec is there)."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / "asyncrl_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(corpus, out, vocab_size=tokenizer_vocab)
    return build_model(out, spec, vocab)
