"""A tokenizer of any vocabulary size, for benchmarks of the config-only built-in models.

The built-in configs (``llama-3.1-8b``, ``qwen3-0.6b``, ...) carry no tokenizer, and a
benchmark of constrained decoding needs one whose vocabulary fills the model's logits: the
token masks' cost grows with the vocabulary. This trains a byte-level BPE (the kind Llama 3
and Qwen use) on the Python standard library's source, which every Python installation
has, to ``vocab_size`` tokens. If the corpus yields fewer merges, the rest of the
vocabulary is filled with tokens that join two learned ones (ordinary vocabulary entries
that decode to text; encoding never produces them). EOS is ``<|eos|>``.

    python -m pagedllm.benchmarks.bench_tokenizer --model llama-3.1-8b --out tok-llama
    pagedllm bench throughput --model llama-3.1-8b --load-format dummy --tokenizer tok-llama ...
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EOS_TOKEN = "<|eos|>"


# Where third-party packages live, under the standard library's directory in some
# installations: left out, so the corpus (and the tokenizer) is the same wherever the
# Python version is.
PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


def corpus(limit_bytes: int = 64 << 20) -> Iterator[str]:
    """Source files of the standard library (not the packages installed beside it), up to
    ``limit_bytes`` in all."""
    total = 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if PACKAGE_DIRS.intersection(path.relative_to(stdlib).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        if total > limit_bytes:
            return
        yield text


def build(vocab_size: int, out_dir: Path, corpus_bytes: int = 64 << 20) -> int:
    """Write tokenizer.json and tokenizer_config.json of exactly ``vocab_size`` tokens,
    trained on up to ``corpus_bytes`` of source; returns how many of them are bytes and
    learned merges (the rest are fillers)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(corpus_bytes), trainer=trainer)
    learned = tokenizer.get_vocab_size()
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    pieces = [token for token in vocab if token != EOS_TOKEN]
    rng = random.Random(0)
    while len(vocab) < vocab_size:
        vocab.setdefault(rng.choice(pieces) + rng.choice(pieces), len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"Built {tokenizer.get_vocab_size()} tokens, not {vocab_size}.")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
              "bos_token": None, "unk_token": None, "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return learned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--vocab-size", type=int, help="Tokens in the vocabulary.")
    size.add_argument("--model", help="A model (directory or built-in config) whose vocab_size "
                                      "the tokenizer takes.")
    parser.add_argument("--out", type=Path, required=True, help="Directory to write.")
    args = parser.parse_args(argv)
    vocab_size = args.vocab_size
    if vocab_size is None:
        from pagedllm.config import resolve_model_path

        config = json.loads((resolve_model_path(args.model) / "config.json").read_text())
        vocab_size = config.get("text_config", config)["vocab_size"]
    learned = build(vocab_size, args.out)
    print(f"{args.out}: {vocab_size} tokens, {learned} of them bytes and learned merges")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
