"""A tiny, deterministic byte-level BPE tokenizer with a chat template, for tests.

``make_tiny_tokenizer(dir, vocab_size=384)`` writes tokenizer.json and tokenizer_config.json
into ``dir`` so that both ``pagedllm.engine.tokenizer.Tokenizer`` and transformers'
``AutoTokenizer`` load it; pair it with a tiny random model whose vocabulary has the same size.

Layout of the vocabulary:
- ids 0..6 are the special tokens, in the order of ``SPECIAL_TOKENS``
  (``<s>`` = BOS, ``</s>`` = EOS, ``<pad>``, then the chat markers);
- ids 7..262 are the 256 byte-level symbols (every byte sequence encodes, no unknown token);
- the rest are BPE merges learned from ``CORPUS`` (English, code, accents, CJK, emoji), so some
  tokens hold whole multi-byte characters and others split them.

Encoding with ``add_special_tokens=True`` prepends ``<s>`` (tokenizer.json's post-processor);
the chat template writes ``<s>`` itself, so chat prompts are encoded without special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS]
END_OF_TURN_TOKEN = "<|end|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nYou may call these tools:\n{{ tools | tojson(indent=2) }}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A paged attention engine stores the keys "
    "and values of every sequence in fixed-size blocks, so memory is allocated on demand and "
    "shared between requests that begin with the same prompt.",
    "Continuous batching adds new requests to the running batch at every step; when the cache "
    "runs out of blocks, the scheduler preempts the newest request and recomputes it later.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "class Block:\n    def __init__(self, block_id: int) -> None:\n        self.block_id = block_id\n"
    "        self.ref_cnt = 0\n        self.hash = None\n",
    "Les élèves étudient à l'école; naïve café crème brûlée. Über straße grüße. Ñandú señor.",
    "你好，世界！今天天气很好。我们一起学习语言模型。日本語のテキストも少し。한국어 문장도 있습니다.",
    "Emoji time: 🎉 🚀 👍🏽 ❤️ 😀😃😄 — party, rocket, thumbs up, heart, smiles. ∑ ∫ √ π ≈ 3.14159",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024-01-31 12:34:56 $42.50 50% #hashtag @user",
    "Question? Answer! Quotes \"double\" and 'single', (parentheses) [brackets] {braces} <angle>.",
    "Once upon a time, in a land far away, there lived a small robot who loved to read books "
    "about stars, oceans, mountains and the people who explore them.",
]


def train_tiny_tokenizer(vocab_size: int = 384) -> Tokenizer:
    """Train the tokenizer in memory. The same ``vocab_size`` always gives the same tokenizer."""
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (specials + 256 bytes), got {vocab_size}.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"The test corpus yields at most {tokenizer.get_vocab_size()} tokens; "
            f"asked for vocab_size={vocab_size}."
        )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def make_tiny_tokenizer(
    directory: str | Path, vocab_size: int = 384, chat_template: str | None = CHAT_TEMPLATE
) -> Path:
    """Write tokenizer.json and tokenizer_config.json into ``directory``; returns it.

    ``chat_template=None`` writes a config without a template.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(vocab_size)
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": {"__type": "AddedToken", "content": EOS_TOKEN, "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": CHAT_TOKENS,
        # tokenizer.json's post-processor adds BOS already; this must not add a second one.
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return directory
