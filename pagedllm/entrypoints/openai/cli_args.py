"""Flags of ``pagedllm serve``: the engine's flags plus the server's own.

Server flags that belong to features not implemented yet are accepted by the parser only to
be refused with a message that says so (never silently ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl

from pagedllm.engine.arg_utils import EngineArgs

API_KEY_ENV = "PAGEDLLM_API_KEY"

# dest -> why it is refused.
_REFUSED_SERVER_FLAGS = {
    "lora_modules": "LoRA adapters are not implemented yet",
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF model directory or hub id (default: the bundled demo model); "
                             "same as --model.")
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0",
                       help="Interface to listen on (default: 0.0.0.0, all of them; 127.0.0.1 for "
                            "this machine only).")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument("--api-server-count", type=int, default=1,
                       help="API server processes sharing the port and the one engine core "
                            "(HTTP, JSON, streaming and detokenization spread over them; more "
                            "than 1 pays on a fast engine whose one API process is busy; "
                            "default 1). --max-num-waiting is split evenly between them.")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help="Require 'Authorization: Bearer KEY' on every path but /health, "
                            f"/metrics, /version and / (default: ${API_KEY_ENV}; unset = no key).")
    group.add_argument("--allowed-origins",
                       default='["*"]',
                       help="Origins whose web pages may call the API from a browser (CORS), "
                            "as a JSON list, e.g. '[\"https://app.example\"]' (default: any, "
                            "[\"*\"]; --api-key still guards the API).")
    group.add_argument("--allowed-methods",
                       default='["*"]', help="HTTP methods those pages may use (CORS), a JSON list "
                                           "(default: any).")
    group.add_argument("--allowed-headers",
                       default='["*"]', help="Request headers those pages may send (CORS), a JSON "
                                           "list (default: any).")
    group.add_argument("--allow-credentials", action="store_true",
                       help="Let those pages send cookies and HTTP authentication (CORS).")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="Names clients use in the 'model' field (default: the model argument).")
    group.add_argument("--chat-template", default=None,
                       help="A Jinja chat template: a file path, a template string, or the name "
                            "of one of the model's templates (default: the model's own).")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="Log level of the HTTP server.")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="Do not log every HTTP request.")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="Do not log the periodic throughput / queue / KV cache line.")
    group.add_argument("--log-stats-interval", type=float, default=5.0,
                       help="Seconds between stats lines while the server is busy.")
    group.add_argument("--metrics-compat", default=None, choices=["vllm"],
                       help="Also export /metrics series under another engine's names, same "
                            "labels and values: vllm maps num_requests_running, "
                            "num_requests_waiting, kv_cache_usage_perc (as vllm:kv_cache_usage_perc "
                            "and vllm:gpu_cache_usage_perc), prompt_tokens_total, "
                            "generation_tokens_total, request_success_total, "
                            "time_to_first_token_seconds, time_per_output_token_seconds, "
                            "e2e_request_latency_seconds, request_queue_time_seconds, "
                            "num_preemptions_total, prefix_cache_queries_total, "
                            "prefix_cache_hits_total and the speculative-decoding counters "
                            "spec_decode_num_drafts_total, spec_decode_num_draft_tokens_total, "
                            "spec_decode_num_accepted_tokens_total and "
                            "spec_decode_num_accepted_tokens_per_pos_total from pagedllm: to "
                            "vllm: (default: none, pagedllm: names only).")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="On SIGTERM, seconds in-flight requests may take to finish before "
                            "they are aborted.")
    group.add_argument("--max-num-waiting", type=int, default=None,
                       help="Refuse new requests with 503 and a Retry-After header while this "
                            "many core requests (a request of n choices is n) wait to be "
                            "scheduled (default: none, the queue is unbounded).")
    group.add_argument("--request-timeout", type=float, default=None,
                       help="Abort a request that has run this many seconds since it arrived "
                            "and answer 504 (a stream ends with an error event) (default: "
                            "none, no limit).")
    group.add_argument("--stream-interval", type=int, default=1,
                       help="A streamed response sends a request's new tokens every N tokens "
                            "(its first token at once, its last with the finish reason): "
                            "fewer, larger chunks and fewer socket writes for the API "
                            "process (default 1: every token).")
    group.add_argument("--max-request-body-bytes", type=int, default=10 * 1024 * 1024,
                       help="Largest request body accepted, in bytes; a larger one is answered "
                            "413 before it is read.")
    group.add_argument("--max-n", type=int, default=128,
                       help="Largest n (choices per request) accepted.")
    group.add_argument("--max-stop-sequences", type=int, default=64,
                       help="Most stop strings one request may send.")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='Answer tool_choice "auto" (the default with tools): the model '
                            "decides, and --tool-call-parser reads its calls.")
    group.add_argument("--tool-call-parser", default=None,
                       help="The model's tool-call format: hermes (Hermes, Qwen 2.5/3), "
                            "llama3_json (Llama 3.1/3.2), mistral, pythonic or llama4_pythonic "
                            "(Llama 3.2/4 pythonic), qwen3_coder (Qwen3-Coder), phi4_mini_json "
                            "(Phi-4-mini) (default: none; needs --enable-auto-tool-choice).")
    group.add_argument("--reasoning-parser", default=None,
                       help="Split <think>...</think> into reasoning_content: deepseek_r1, "
                            "qwen3; [THINK]...[/THINK] (Magistral): mistral (default: none, the "
                            "reasoning stays in content).")
    group.add_argument("--disable-web-ui", action="store_true",
                       help="Do not serve the playground page at / (chat, structured output, "
                            "tools and live engine charts in a browser); / then answers 404 "
                            "and the API is unchanged.")
    group.add_argument("--guided-decoding-backend", default=None,
                       help="The structured-output backend: llguidance (also 'auto', "
                            "'guidance'; default: llguidance).")
    group.add_argument("--disable-log-requests", action="store_true", default=False,
                       help="Accepted as vLLM takes it: the server logs no request's "
                            "prompt or parameters in any case.")
    group.add_argument("--ssl-keyfile", default=None,
                       help="Serve HTTPS: the private key file (PEM); with --ssl-certfile.")
    group.add_argument("--ssl-certfile", default=None,
                       help="Serve HTTPS: the certificate chain file (PEM); with --ssl-keyfile.")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="The CA certificates (PEM) that client certificates are checked "
                            "against (with --ssl-cert-reqs 1 or 2).")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                       help="Client certificates: 0 not asked for (default), 1 checked when "
                            "sent, 2 required (mutual TLS), as Python's ssl.CERT_* values.")
    # Accepted so the refusal message is clear rather than argparse's "unrecognized".
    group.add_argument("--lora-modules", nargs="+", default=None, help=argparse.SUPPRESS)


def _json_strings(text: str, flag: str) -> list[str]:
    """``text`` as a JSON list of strings; a ValueError naming ``flag`` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', got {text!r}.")
    return value


def _check_tls_args(args: argparse.Namespace) -> None:
    """HTTPS needs a key and its certificate; client certificates need the CAs to check
    them against; every file must be readable now, not at the first connection."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        given, missing = (("--ssl-keyfile", "--ssl-certfile") if args.ssl_keyfile
                          else ("--ssl-certfile", "--ssl-keyfile"))
        raise ValueError(f"{given} needs {missing} too: HTTPS takes a private key and its "
                         f"certificate.")
    if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got "
                         f"{args.ssl_cert_reqs}.")
    if not args.ssl_certfile and (args.ssl_ca_certs or args.ssl_cert_reqs != ssl.CERT_NONE):
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs take effect with HTTPS: add "
                         "--ssl-keyfile and --ssl-certfile.")
    if args.ssl_cert_reqs != ssl.CERT_NONE and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 checks client certificates against "
                         "--ssl-ca-certs: add it.")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{flag} {path}: no such readable file.")
    if args.ssl_certfile:  # as the server will load them, before the model loads
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=_no_password)
            if args.ssl_ca_certs:
                context.load_verify_locations(args.ssl_ca_certs)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--ssl-keyfile / --ssl-certfile / --ssl-ca-certs: the files do "
                             f"not load as a PEM key, its certificate and CA certificates "
                             f"({exc}).") from None


def _no_password() -> str:
    """An encrypted key would make OpenSSL prompt on the terminal: refuse it instead."""
    raise ValueError("--ssl-keyfile is encrypted: give a key file without a passphrase.")


def validate_serve_args(args: argparse.Namespace) -> None:
    """Resolve the positional model and refuse what is not implemented (ValueError)."""
    for dest, reason in _REFUSED_SERVER_FLAGS.items():
        if getattr(args, dest, None):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} is not supported: {reason}. Remove {flag}.")
    _check_tls_args(args)
    for dest in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, dest)
        if isinstance(value, str):
            setattr(args, dest, _json_strings(value, "--" + dest.replace("_", "-")))
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (the model's "
                         "tool-call format): add it.")
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        raise ValueError("--tool-call-parser takes effect with --enable-auto-tool-choice: add "
                         "it, or remove --tool-call-parser.")
    if args.tool_call_parser:
        from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

        get_tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        from pagedllm.entrypoints.openai.reasoning import get_reasoning_parser

        get_reasoning_parser(args.reasoning_parser)
    if args.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
        raise ValueError(f"--guided-decoding-backend {args.guided_decoding_backend!r} is not "
                         "available: structured outputs use llguidance. Remove the flag.")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(
                f"The model is given twice ({args.model_tag!r} and --model {args.model!r}): "
                "pass one."
            )
        args.model = args.model_tag
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}.")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}.")
    if args.max_num_waiting is not None and 1 <= args.max_num_waiting < args.api_server_count:
        raise ValueError(f"--max-num-waiting ({args.max_num_waiting}) is split between the "
                         f"{args.api_server_count} API server processes: give at least "
                         f"{args.api_server_count}, or fewer processes.")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}.")
    if args.max_num_waiting is not None and args.max_num_waiting < 1:
        raise ValueError(f"--max-num-waiting must be >= 1, got {args.max_num_waiting}.")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}.")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}.")
    for flag in ("max_request_body_bytes", "max_n", "max_stop_sequences"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    if args.log_stats_interval <= 0:
        raise ValueError(f"--log-stats-interval must be > 0, got {args.log_stats_interval}.")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or unset it to serve without one.")
