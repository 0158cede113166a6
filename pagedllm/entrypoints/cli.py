"""The ``pagedllm`` command: ``serve``, ``generate``, ``chat``, ``doctor``, ``plan`` and ``bench``.

    pagedllm serve --port 8000        # the OpenAI-compatible server (bundled demo model)
    pagedllm generate "def fibonacci(n):" --max-tokens 64
    pagedllm generate --model qwen3-0.6b --load-format dummy --prompt-token-ids 1,2,3
    pagedllm chat "Write a function that reverses a list."
    pagedllm doctor --max-model-len 8192       # check the setup, with the serve flags
    pagedllm plan --model llama-3.1-70b --requests-per-day 1000000 --candidates gpus.yaml
    pagedllm bench throughput --num-prompts 64 --input-len 64:256 --output-len 64:256
    pagedllm bench latency --model llama-3.1-8b --load-format dummy   # L1 and P1
    pagedllm bench overhead --num-requests 256
    pagedllm bench serve --num-prompts 64 --request-rate 4   # against a running server
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.engine.arg_utils import EngineArgs, HelpFormatter


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128,
                       help="Most tokens to generate per completion.")
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy.")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="Sample from the smallest set of tokens whose probability reaches P.")
    group.add_argument("--top-k", type=int, default=0,
                       help="Sample from the K most likely tokens; 0 means all.")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="Drop tokens less likely than P times the most likely one.")
    group.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    group.add_argument("--stop", action="append", default=None,
                       help="A stop string (repeatable; default: none).")
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="Per-request sampling seed (default: none: unseeded requests draw "
                            "from the engine's generator, seeded by --seed).")
    constraint = parser.add_argument_group(
        "structured output (one of these; the output is complete when it matches)")
    constraint.add_argument("--json-schema", metavar="FILE", default=None,
                            help="A JSON schema file the output must validate against.")
    constraint.add_argument("--json-object", action="store_true",
                            help="The output is one JSON object.")
    constraint.add_argument("--regex", default=None, help="A regex the output must fully match.")
    constraint.add_argument("--choice", action="append", default=None,
                            help="One allowed output (repeatable): the output is one of them.")
    constraint.add_argument("--grammar", metavar="FILE", default=None,
                            help="A Lark or GBNF grammar file the output must match.")


def _structured_outputs(args: argparse.Namespace):
    """The output constraint the flags ask for, or None; ValueError for two or a bad file."""
    from pathlib import Path

    from pagedllm.structured import StructuredOutputsParams

    def read(path: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"Cannot read {path}: {exc.strerror}.") from None

    given = {
        "json": read(args.json_schema) if args.json_schema else None,
        "json_object": args.json_object,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": read(args.grammar) if args.grammar else None,
    }
    given = {k: v for k, v in given.items() if v}
    if not given:
        return None
    if len(given) > 1:
        flags = {"json": "--json-schema", "json_object": "--json-object", "regex": "--regex",
                 "choice": "--choice", "grammar": "--grammar"}
        raise ValueError(f"Give one output constraint, not {' and '.join(flags[k] for k in given)}.")
    return StructuredOutputsParams(**given)


def _sampling_params(args: argparse.Namespace):
    from pagedllm import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, n=args.n, stop=args.stop, seed=args.sampling_seed,
        structured_outputs=_structured_outputs(args),
    )


def _token_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (an argparse type)."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}")
    return ids


def _make_llm(args: argparse.Namespace, text_needs: str | None = None):
    """The engine of ``args``. ``text_needs`` ("A text prompt", "A chat"): the command reads
    text, so a model without a tokenizer is refused (ValueError) before any weights load."""
    from pagedllm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    if text_needs is not None:
        model_config = engine_args.create_engine_config().model_config
        if model_config.skip_tokenizer_init:
            raise ValueError(
                f"{text_needs} needs a tokenizer, but {model_config.path.name} runs without one "
                "(no tokenizer files, or --skip-tokenizer-init): give a tokenizer with "
                "--tokenizer DIR, or pass token ids with "
                f"{'' if args.command == 'generate' else 'pagedllm generate '}"
                "--prompt-token-ids 1,2,3 (repeatable, one prompt each)."
            )
    return LLM(**vars(engine_args))


def _cmd_generate(args: argparse.Namespace) -> None:
    token_prompts = [{"prompt_token_ids": ids} for ids in args.prompt_token_ids or []]
    if not args.prompts and not token_prompts:
        raise ValueError("Give a prompt: text, or token ids with --prompt-token-ids 1,2,3.")
    params = _sampling_params(args)
    llm = _make_llm(args, "A text prompt" if args.prompts else None)
    tokenizer = llm.get_tokenizer()
    for output in llm.generate([*args.prompts, *token_prompts], params, use_tqdm=False):
        for completion in output.outputs:
            if tokenizer is None:  # token-id mode: the ids are the output
                print("prompt token ids: " + ",".join(map(str, output.prompt_token_ids)))
                print("output token ids: " + ",".join(map(str, completion.token_ids)))
            else:
                prompt = output.prompt
                if prompt is None:
                    prompt = tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
                print(prompt + completion.text)
            print(f"--- [{completion.finish_reason}, {len(completion.token_ids)} tokens]")


def _cmd_chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    llm = _make_llm(args, "A chat")
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.message})
    output = llm.chat(messages, params, use_tqdm=False)[0]
    for completion in output.outputs:
        print(completion.text)


def _cmd_serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run

    code = run(args)
    if code:
        sys.exit(code)


def _cmd_doctor(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.doctor import run

    code = run(args)
    if code:
        sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="INFO",
                        help="DEBUG, INFO, WARNING or ERROR.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, text: str, description: str | None = None, **kwargs):
        return sub.add_parser(name, help=text, description=description or text,
                              formatter_class=HelpFormatter, **kwargs)

    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    serve = add_parser("serve", "Run the OpenAI-compatible HTTP server.")
    add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)

    gen = add_parser("generate", "Complete prompts offline and print the text.")
    gen.add_argument("prompts", nargs="*", help="Prompt text (one or more).")
    gen.add_argument("--prompt-token-ids", type=_token_ids, action="append", default=None,
                     metavar="IDS",
                     help="A prompt as comma-separated token ids, e.g. 1,2,3 (repeatable, one "
                          "prompt each); the way to prompt a model without a tokenizer, whose "
                          "output is printed as token ids.")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = add_parser("chat", "Answer one user message with the model's chat template.")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="An optional system message.")
    _add_sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=_cmd_chat)

    from pagedllm.entrypoints import doctor

    doc = add_parser("doctor", "Check the setup before serving (takes the serve flags).",
                     description=doctor.__doc__)
    doctor.add_cli_args(doc)
    doc.set_defaults(func=_cmd_doctor)

    from pagedllm.entrypoints import plan

    planner = add_parser("plan", "GPUs and cost per day of a traffic profile, per candidate "
                         "deployment.", description=plan.__doc__)
    plan.add_cli_args(planner)
    planner.set_defaults(func=plan.run)

    bench = add_parser("bench", "Benchmarks.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagedllm.benchmarks import latency, overhead, throughput
    from pagedllm.benchmarks import serve as serve_bench

    for name, module, text in (
        ("throughput", throughput, "Offline throughput on a synthetic workload."),
        ("latency", latency, "Batch-1 decode latency (L1) and prefill throughput (P1)."),
        ("overhead", overhead, "CPU cost of schedule + input preparation per step."),
        ("serve", serve_bench, "Latency and throughput of a running server (TTFT, TPOT, ITL)."),
    ):
        p = bench_sub.add_parser(name, help=text, description=module.__doc__,
                                 formatter_class=HelpFormatter)
        module.add_cli_args(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
