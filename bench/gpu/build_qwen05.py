"""Build a Qwen2-0.5B-shaped model with random weights (bf16) and a local tokenizer, in its own process.

    python -m bench.gpu.build_qwen05 OUT_DIR [--vocab N] [--layers N]      (from the repository root)

The GPU benchmarks use it through ``ASYNCRL_BENCH_MODEL=OUT_DIR`` (see ``bench.common.build_model``).
"""

from __future__ import annotations

import argparse

from asyncrl.testing.tasks import arithmetic
from asyncrl.testing.tiny import TinyModelSpec, build_tiny

QWEN05 = TinyModelSpec(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                       tie_word_embeddings=True, dtype="bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--vocab", type=int, default=QWEN05.vocab_size)
    parser.add_argument("--layers", type=int, default=QWEN05.num_hidden_layers)
    args = parser.parse_args()
    spec = TinyModelSpec(**{**{f: getattr(QWEN05, f) for f in QWEN05.__slots__},
                            "vocab_size": args.vocab, "num_hidden_layers": args.layers})
    build_tiny(args.out, arithmetic.corpus(), spec)
    print("built", args.out, flush=True)


if __name__ == "__main__":
    main()
