"""Train the two models that ship inside pagedllm: ``pagedllm-demo`` and its draft.

Both are Llama-architecture causal LMs (Hugging Face ``LlamaForCausalLM``) with one shared
byte-level BPE tokenizer, trained from a fixed seed on the running Python's standard
library source (or the one ``--stdlib`` names) plus chat samples built from its documented
functions (see ``demo_model_data.py``). The shipped weights come from CPython 3.11.7's
standard library (docs/demo_model.md). The script writes, under ``--out``::

    pagedllm-demo/         config.json, generation_config.json, model.safetensors,
    pagedllm-demo-draft/   tokenizer.json, tokenizer_config.json, training_metrics.json
    metrics.json           corpus summary, both models' metrics and sample outputs

Units: losses are mean negative log-likelihood per token in nats; perplexity is
``exp(nll)``; ``nll_over_ln_vocab`` divides by the loss of a uniform guess, ``ln(vocab)``.
The weights kept are those of the evaluation step with the lowest loss on the
"validation" held-out files; the reported held-out numbers are on the separate "test"
files, which play no part in training or in that choice.

Full run (GPU, bf16 autocast; a few minutes on one H200)::

    python scripts/train_demo_model.py --out build/demo-models

Smoke run (CPU, under a minute)::

    python scripts/train_demo_model.py --out /tmp/demo-smoke --device cpu --steps 10 \\
        --draft-steps 10 --batch-size 4 --seq-len 128 --max-files 80 --eval-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model_data import (  # noqa: E402
    BOS_TOKEN, EOS_TOKEN, Corpus, function_records, load_stdlib_corpus, render_chat,
    render_chat_sample,
)
from demo_model_tokenizer import save_tokenizer, train_tokenizer  # noqa: E402

TARGET_NAME = "pagedllm-demo"
DRAFT_NAME = "pagedllm-demo-draft"
MAX_POSITION_EMBEDDINGS = 1024


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one model. float32 weights: 4 bytes per parameter on disk."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 64


# Target: 3.85M parameters, 14.7 MiB in float32. Draft: 1.16M parameters, 4.4 MiB.
TARGET = ModelSpec(TARGET_NAME, hidden_size=256, intermediate_size=352, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2)
DRAFT = ModelSpec(DRAFT_NAME, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=2)

SAMPLE_PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef read_lines(path):",
    "class Stack:\n",
]
SAMPLE_CHATS = [
    [{"role": "user", "content": "Write a Python function `is_palindrome(s)`. "
      "Return True if the string reads the same forwards and backwards."}],
    [{"role": "system", "content": "You are a helpful assistant that writes Python code."},
     {"role": "user", "content": "Write a Python function `count_words(path)`. "
      "Return the number of words in the file at path."}],
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512, help="training sequence length (tokens)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--steps", type=int, default=3000, help="target model optimizer steps")
    p.add_argument("--draft-steps", type=int, default=3000, help="draft model optimizer steps")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=200, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--chat-fraction", type=float, default=0.2,
                   help="share of training tokens that are chat samples")
    p.add_argument("--eval-every", type=int, default=100, help="steps between validation runs")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="cap on tokens per held-out split (default: all)")
    p.add_argument("--stdlib", default=None,
                   help="standard library directory to train on (default: this Python's)")
    p.add_argument("--max-files", type=int, default=None,
                   help="use an evenly spread subset of the stdlib files (smoke runs)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="minutes of training per model after which training stops early")
    p.add_argument("--sample-tokens", type=int, default=96,
                   help="new tokens per greedy sample written to the metrics")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.seq_len > MAX_POSITION_EMBEDDINGS:
        p.error(f"--seq-len must be at most {MAX_POSITION_EMBEDDINGS}, got {args.seq_len}")
    if not 0.0 <= args.chat_fraction < 1.0:
        p.error(f"--chat-fraction must be in [0, 1), got {args.chat_fraction}")
    for name in ("steps", "draft_steps", "batch_size", "eval_every", "sample_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- data

@dataclass
class TokenData:
    train: torch.Tensor  # (num_chunks, seq_len) int64, packed documents
    validation: torch.Tensor  # 1-D held-out stream, documents concatenated
    test: torch.Tensor
    summary: dict


def _encode_docs(tokenizer, texts: list[str], bos_id: int, eos_id: int) -> list[list[int]]:
    """Each text as ``<|bos|> ids <|end|>`` (text may already start with <|bos|>)."""
    docs = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids = enc.ids
        docs.append((ids if ids[:1] == [bos_id] else [bos_id, *ids]) + [eos_id])
    return docs


def _chat_docs(tokenizer, corpus: Corpus, wanted_tokens: int, seed: int, bos_id: int,
               eos_id: int) -> list[list[int]]:
    """Chat samples until ``wanted_tokens``; repeated passes rephrase the same functions."""
    records = function_records(corpus.train)
    rng = random.Random(seed + 1)
    docs: list[list[int]] = []
    total = 0
    for _ in range(4):  # at most four phrasings of one function
        order = records[:]
        rng.shuffle(order)
        rendered = [render_chat_sample(record, rng) for record in order]
        # A rendered chat ends with "<|end|>\n"; the document ends at that <|end|>.
        for doc in _encode_docs(tokenizer, [t.rstrip("\n").removesuffix(EOS_TOKEN)
                                            for t in rendered], bos_id, eos_id):
            if total >= wanted_tokens:
                return docs
            docs.append(doc)
            total += len(doc)
    return docs


def build_data(args: argparse.Namespace, corpus: Corpus, tokenizer) -> TokenData:
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    code_docs = _encode_docs(tokenizer, [f.text for f in corpus.train], bos_id, eos_id)
    code_tokens = sum(map(len, code_docs))
    wanted = int(code_tokens * args.chat_fraction / (1.0 - args.chat_fraction))
    chat_docs = _chat_docs(tokenizer, corpus, wanted, args.seed, bos_id, eos_id)
    chat_tokens = sum(map(len, chat_docs))
    docs = code_docs + chat_docs
    random.Random(args.seed).shuffle(docs)
    stream = torch.tensor([t for doc in docs for t in doc], dtype=torch.long)
    num_chunks = len(stream) // args.seq_len
    if num_chunks < args.batch_size:
        raise ValueError(
            f"only {num_chunks} training sequences of {args.seq_len} tokens: lower "
            f"--batch-size or --seq-len, or raise --max-files."
        )
    train = stream[: num_chunks * args.seq_len].view(num_chunks, args.seq_len)

    def held_out(files) -> torch.Tensor:
        docs = _encode_docs(tokenizer, [f.text for f in files], bos_id, eos_id)
        ids = torch.tensor([t for doc in docs for t in doc], dtype=torch.long)
        return ids[: args.eval_tokens] if args.eval_tokens else ids

    validation, test = held_out(corpus.validation), held_out(corpus.test)
    summary = {
        "python": platform.python_version(),  # the interpreter; --stdlib may name another's
        "stdlib": corpus.root,
        "stdlib_files": {"train": len(corpus.train), "validation": len(corpus.validation),
                         "test": len(corpus.test)},
        "validation_files": [f.relpath for f in corpus.validation],
        "test_files": [f.relpath for f in corpus.test],
        "code_tokens": code_tokens,
        "chat_samples": len(chat_docs),
        "chat_tokens": chat_tokens,
        "chat_fraction": round(chat_tokens / (code_tokens + chat_tokens), 4),
        "train_tokens": int(train.numel()),
        "validation_tokens": int(validation.numel()),
        "test_tokens": int(test.numel()),
    }
    return TokenData(train, validation, test, summary)


# ----------------------------------------------------------------------------- model

def make_config(spec: ModelSpec, vocab_size: int, bos_id: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS, rope_theta=10000.0,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None,
        initializer_range=0.02,
    )


def lr_at(step: int, args: argparse.Namespace, total: int) -> float:
    """Linear warmup to ``--lr``, then cosine decay to a tenth of it at ``total``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def mean_nll(model, stream: torch.Tensor, seq_len: int, batch_size: int, device: str) -> float:
    """Mean NLL per predicted token (nats) over ``stream`` cut into ``seq_len`` windows.

    Windows do not overlap, so the first token of each window is context only.
    Evaluated in float32 without autocast.
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    full = len(stream) // seq_len
    windows = stream[: full * seq_len].view(full, seq_len)
    for i in range(0, full, batch_size):
        batch = windows[i:i + batch_size].to(device)
        logits = model(input_ids=batch).logits.float()
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                              reduction="sum")
        total, count = total + nll.item(), count + batch[:, 1:].numel()
    tail = stream[full * seq_len:]
    if len(tail) >= 2:
        batch = tail.unsqueeze(0).to(device)
        logits = model(input_ids=batch).logits.float()
        total += F.cross_entropy(logits[0, :-1], batch[0, 1:], reduction="sum").item()
        count += len(tail) - 1
    model.train(was_training)
    if count == 0:
        raise ValueError("held-out stream has fewer than 2 tokens: raise --eval-tokens.")
    return total / count


def train_model(spec: ModelSpec, steps: int, args: argparse.Namespace, data: TokenData,
                tokenizer, device: str):
    """Returns the model holding the best-validation weights (float32) and its metrics."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = make_config(spec, tokenizer.get_vocab_size(), tokenizer.token_to_id(BOS_TOKEN),
                         tokenizer.token_to_id(EOS_TOKEN))
    model = LlamaForCausalLM(config).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"{spec.name}: {num_params:,} parameters, {steps} steps")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.startswith("cuda"),
    )
    forward = torch.compile(model) if args.compile else model
    use_bf16 = device.startswith("cuda")
    train = data.train.to(device)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=gen)
    cursor = 0
    losses: list[torch.Tensor] = []  # detached per-step losses: no host sync per step
    best = (float("inf"), 0, None)  # (validation nll, step, state dict on CPU)
    start = time.perf_counter()
    step = 0
    stopped_early = False
    model.train()
    for step in range(1, steps + 1):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train), generator=gen), 0
        batch = train[order[cursor:cursor + args.batch_size].to(device)]
        cursor += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, args, steps)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_bf16):
            logits = forward(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        elapsed = time.perf_counter() - start
        out_of_time = args.time_limit is not None and elapsed > args.time_limit * 60
        if step % args.eval_every == 0 or step == steps or out_of_time:
            val = mean_nll(model, data.validation, args.seq_len, args.batch_size, device)
            if val < best[0]:
                state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                best = (val, step, state)
            tok_s = step * args.batch_size * args.seq_len / elapsed
            log(f"{spec.name} step {step}/{steps} loss {losses[-1].item():.4f} val {val:.4f} "
                f"lr {lr_at(step - 1, args, steps):.2e} {tok_s:,.0f} tok/s {elapsed:.0f}s")
        elif step % 50 == 0:
            log(f"{spec.name} step {step}/{steps} loss {losses[-1].item():.4f} {elapsed:.0f}s")
        if out_of_time:
            stopped_early = True
            log(f"{spec.name}: --time-limit reached at step {step}, stopping")
            break
    train_seconds = time.perf_counter() - start
    model.load_state_dict(best[2])
    final_train_loss = torch.stack(losses[-100:]).float().mean().item()  # last 100 steps
    ln_vocab = math.log(config.vocab_size)
    val_nll = mean_nll(model, data.validation, args.seq_len, args.batch_size, device)
    test_nll = mean_nll(model, data.test, args.seq_len, args.batch_size, device)
    metrics = {
        "name": spec.name,
        "parameters": num_params,
        "shape": {k: v for k, v in spec.__dict__.items() if k != "name"},
        "train_steps": step,
        "planned_steps": steps,
        "stopped_early": stopped_early,
        "best_step": best[1],
        "tokens_seen": step * args.batch_size * args.seq_len,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": round(final_train_loss, 4),
        "validation_nll": round(val_nll, 4),
        "test_nll": round(test_nll, 4),
        "test_perplexity": round(math.exp(test_nll), 3),
        "ln_vocab": round(ln_vocab, 4),
        "test_nll_over_ln_vocab": round(test_nll / ln_vocab, 4),
    }
    log(f"{spec.name}: {json.dumps(metrics)}")
    return model.float(), metrics


# ----------------------------------------------------------------------------- output

def save_model(model, out_dir: Path, tokenizer, metrics: dict) -> None:
    """Hugging Face layout, float32 safetensors, plus explicit configs readers agree on."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out_dir, safe_serialization=True)
    config = json.loads((out_dir / "config.json").read_text())
    # Both spellings: older readers look for these top-level keys.
    config["torch_dtype"] = "float32"
    config.setdefault("rope_theta", 10000.0)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_tokenizer(tokenizer, out_dir, MAX_POSITION_EMBEDDINGS)
    (out_dir / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


@torch.no_grad()
def sample_outputs(model, tokenizer, device: str, max_new_tokens: int) -> list[dict]:
    """Greedy continuations of fixed prompts: raw completions and chat replies."""
    model.to(device).eval()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    cases = [(p, tokenizer.encode(p).ids) for p in SAMPLE_PROMPTS]
    for chat in SAMPLE_CHATS:
        text = render_chat(chat, add_generation_prompt=True)
        cases.append((text, tokenizer.encode(text, add_special_tokens=False).ids))
    results = []
    for prompt, ids in cases:
        inputs = torch.tensor([ids], device=device)
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=eos_id)
        results.append({"prompt": prompt,
                        "completion": tokenizer.decode(out[0, len(ids):].tolist(),
                                                       skip_special_tokens=True)})
    return results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t0 = time.perf_counter()
    corpus = load_stdlib_corpus(args.stdlib, max_files=args.max_files)
    log(f"stdlib {corpus.root}: {len(corpus.train)} train, {len(corpus.validation)} "
        f"validation, {len(corpus.test)} test files")
    tokenizer = train_tokenizer((f.text for f in corpus.train), args.vocab_size)
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens ({time.perf_counter() - t0:.0f}s)")
    data = build_data(args, corpus, tokenizer)
    log(f"data: {json.dumps({k: v for k, v in data.summary.items() if not k.endswith('_files')})}"
        f" ({time.perf_counter() - t0:.0f}s)")
    results = {"seed": args.seed, "device": device,
               "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
               "data": data.summary, "models": {}, "samples": {}}
    for spec, steps in ((TARGET, args.steps), (DRAFT, args.draft_steps)):
        model, metrics = train_model(spec, steps, args, data, tokenizer, device)
        metrics["samples"] = sample_outputs(model, tokenizer, device, args.sample_tokens)
        save_model(model, args.out / spec.name, tokenizer, metrics)
        results["models"][spec.name] = metrics
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    import transformers

    results["transformers"] = transformers.__version__
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    summary = {name: {k: m[k] for k in ("train_steps", "tokens_seen", "final_train_loss",
                                         "validation_nll", "test_nll", "test_perplexity",
                                         "test_nll_over_ln_vocab")}
               for name, m in results["models"].items()}
    log(f"done in {results['total_seconds']}s: {json.dumps(summary)}")
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
