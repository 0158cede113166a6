"""The OpenAI-compatible HTTP server: ``pagedllm serve`` (FastAPI on uvicorn).

    pagedllm serve [MODEL] --port 8000
    python -m pagedllm.entrypoints.openai.api_server --model MODEL

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/responses`` (with ``GET`` and ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``), ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /version``, ``GET /metrics`` (Prometheus), and
the playground page at ``GET /`` (``web_ui.py``; ``--disable-web-ui`` removes it).

Lifecycle: the listening socket is bound first (a taken port fails in a second, not after
the model loads), then the engine core process starts; its startup errors end the command
with a non-zero status and their message. SIGTERM (or Ctrl-C) stops accepting connections,
lets in-flight requests finish for up to ``--shutdown-timeout`` seconds, aborts the rest,
stops the core and exits 0. If the core dies while serving (killed, or an exception in a
step), within about a second every in-flight request ends with a 500 (a stream with an
error event, then ``[DONE]``), new requests and ``/health`` get 503, and the server stops
and exits 1, so a supervisor restarts it. An unexpected exception in a handler is a 500
with a generic message; its traceback stays in the server's log.

A client that disconnects aborts its request at once: streaming responses notice through
the ASGI disconnect event, non-streaming ones race the handler against it.

With ``--api-server-count N``, this process (process 0) starts the core, then N-1 more API
processes (``_run_attached``) that accept on the same socket and attach to the core. On
SIGTERM it passes the signal on, so all of them drain at once, and stops the core last. If
one of them exits non-zero, process 0 stops with status 1. An attached process stops when
the core or process 0 dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import multiprocessing
import shutil
import signal
import socket
import sys
import tempfile
import time

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.config import DEFAULT_MODEL
from pagedllm.engine import gc_tuning
from pagedllm.engine.arg_utils import EngineArgs, HelpFormatter
from pagedllm.engine.async_engine import (
    AsyncEngine, EngineDeadError, EngineStartupError, RequestTimeoutError,
)
from pagedllm.engine.core_client import CoreHandle
from pagedllm.entrypoints import event_loop
from pagedllm.entrypoints.openai.cli_args import add_serve_args, validate_serve_args
from pagedllm.entrypoints.openai.protocol import (
    INTERNAL_ERROR_MESSAGE, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
    OpenAIError, ResponsesRequest, TokenizeRequest, error_body,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, load_chat_template
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import RequestLimits, timeout_error
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.web_ui import add_web_ui, display_url
from pagedllm.metrics import KVCacheShape, ServerMetrics, StatsLogger

logger = logging.getLogger("pagedllm.server")

# The only paths open without the API key when one is set: probes and Prometheus, the
# version, and the playground page (which asks for the key itself). Every other path, the
# OpenAPI schema and its docs pages included, needs the key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/"})


# -- building blocks ----------------------------------------------------------------------
class APIKeyMiddleware:
    """Answers 401 on every path but ``OPEN_PATHS`` unless ``Authorization: Bearer <key>``
    matches (constant-time compare)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            await self.app(scope, receive, send)
            return
        message = ("Missing API key: send the header 'Authorization: Bearer <key>'." if not auth
                   else "Incorrect API key provided.")
        response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyTooLargeError(StarletteHTTPException):
    """Raised while reading a body past the limit; an HTTPException, so the framework's
    body parsing passes it on unchanged to its handler."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(status_code=error.status, detail=error.message)
        self.error = error


class BodySizeLimitMiddleware:
    """Answers 413 (OpenAI's error shape, naming the limit and its flag) to a request body
    over ``max_bytes``: at once from ``Content-Length``, or as soon as a chunked body
    passes the limit (the rest is never read)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> OpenAIError:
        return OpenAIError(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes): send less, or raise the limit.", status=413,
            code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = self._error()
            await JSONResponse(error.body(), status_code=error.status,
                               headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self._error())
            return message

        await self.app(scope, limited_receive, send)


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, so its requests are aborted
    whether the stream ends, fails, or the client goes away."""

    def __init__(self, content) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(RuntimeError):
                await self.body_iterator.aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(awaitable, request: Request):
    """The awaitable's result, or None (and the awaitable cancelled) if the client left first.

    The awaitable runs in the calling task, so a request reaches the engine before this
    task first waits: under a burst of arrivals each is submitted as soon as its body is
    parsed, not after every other arrival's turn on the loop. A second task watches for the
    disconnect and cancels this one.
    """
    task = asyncio.current_task()
    left = False

    async def watch() -> None:
        nonlocal left
        await _wait_for_disconnect(request)
        left = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not left:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+ counts cancellations; this one is done
            task.uncancel()
        return None
    finally:
        watcher.cancel()


async def _answer(handler, request, raw_request: Request):
    """``handler(request, arrival time)`` raced against the client's going away, answered
    (``_respond``); the arrival is taken as the body is parsed."""
    arrival = time.monotonic()
    return _respond(await run_until_disconnected(handler(request, arrival), raw_request))


def _respond(result):
    if result is None:  # the client disconnected; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return Response(content=result.model_dump_json(), media_type="application/json")
    if isinstance(result, dict):
        return JSONResponse(result)
    return SSEResponse(result)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return OpenAIError(f"The request body is not valid JSON ({detail}).")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc:
        return OpenAIError("The request needs a JSON object body.")
    field = loc[0]
    path = ".".join(loc)
    return OpenAIError(f"Invalid value for {field} ({path}): {first.get('msg', 'invalid')}.",
                       param=field)


# -- the app ------------------------------------------------------------------------------
def build_app(engine: AsyncEngine, models: OpenAIServingModels, metrics: ServerMetrics | None = None,
              chat_template: str | None = None, api_key: str | None = None,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              web_ui: bool = True, limits: RequestLimits | None = None,
              cors: dict | None = None) -> FastAPI:
    """``tool_call_parser`` (set with --enable-auto-tool-choice) and ``reasoning_parser``
    are registry names (tool_parsers/, reasoning/); ``web_ui`` serves the playground at ``/``;
    ``limits`` caps what one request may ask for (default: ``RequestLimits()``); ``cors``:
    Starlette's ``CORSMiddleware`` settings (the --allowed-* flags), None for no CORS headers."""
    limits = limits or RequestLimits()
    from pagedllm.entrypoints.openai.reasoning import get_reasoning_parser
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

    app = FastAPI(title="pagedllm", version=pagedllm.__version__,
                  description="An OpenAI-compatible LLM server.")
    completions = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(
        engine, models, chat_template,
        tool_parser=get_tool_parser(tool_call_parser)(engine.tokenizer) if tool_call_parser else None,
        reasoning_parser=(get_reasoning_parser(reasoning_parser)(engine.tokenizer)
                          if reasoning_parser else None),
    )
    completions.limits = chat.limits = limits
    responses = OpenAIServingResponses(chat)
    tokenization = OpenAIServingTokenization(chat)
    # The last one added runs first: the key is checked before any body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors is not None:  # outermost: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, **cors)
    if web_ui:
        add_web_ui(app, {"version": pagedllm.__version__, "api_key_required": bool(api_key),
                         "tool_call_parser": tool_call_parser,
                         "reasoning_parser": reasoning_parser,
                         "metrics": metrics is not None})

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(BodyTooLargeError)
    async def _body_too_large(_: Request, exc: BodyTooLargeError):
        return JSONResponse(exc.error.body(), status_code=exc.error.status,
                            headers={"Connection": "close"})

    @app.exception_handler(RequestTimeoutError)
    async def _timed_out(_: Request, exc: RequestTimeoutError):
        error = timeout_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError):
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(error_body(message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError):
        # An in-flight request whose engine died; new requests are refused with a 503.
        return JSONResponse(error_body(str(exc), "server_error"), status_code=500)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("Unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(INTERNAL_ERROR_MESSAGE, "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse(error_body(str(engine.dead_error), "server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise OpenAIError("Metrics are disabled.", status=404)
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models():
        return Response(content=models.list_models().model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        models.resolve(model_id)
        card = next(c for c in models.list_models().data if c.id == model_id)
        return Response(content=card.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await _answer(completions.create_completion, request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await _answer(chat.create_chat_completion, request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return await _answer(responses.create_response, request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False):
        if stream:
            raise OpenAIError("A stored response is sent whole: retrieve it without stream.",
                              param="stream")
        return _respond(responses.retrieve(response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: str | None = None, limit: int = 20,
                               order: str = "desc", include: list[str] | None = Query(None)):
        return _respond(responses.input_items(response_id, after, limit, order, include))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return _respond(responses.delete(response_id))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return _respond(await asyncio.to_thread(tokenization.tokenize, request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return _respond(tokenization.detokenize(request))

    return app


# -- running ------------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"Cannot listen on {host}:{port} ({exc.strerror}): pick another --port "
                         "or stop the process using it.") from None
    sock.set_inheritable(False)
    return sock


async def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit status."""
    validate_serve_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    chat_template = load_chat_template(args.chat_template)  # fails before the model loads
    config = engine_args.create_engine_config()
    sock = _bind(args.host, args.port)
    count = args.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="pagedllm-metrics-") if count > 1 else None
    metrics = ServerMetrics(_served_names(args)[0], compat=args.metrics_compat,
                            multiprocess_dir=metrics_dir)
    log_level = str(logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    try:
        engine = await AsyncEngine.start(config, metrics, log_level=log_level,
                                         num_api_servers=count, **_engine_limits(args))
    except EngineStartupError as exc:
        sock.close()
        print(f"error: the engine could not start: {exc}", file=sys.stderr)
        return 1
    info = engine.info
    url = display_url(args.host, args.port, https=bool(args.ssl_certfile))
    logger.info(
        "pagedllm %s serving %s at %sv1 (model %s, %s on %s); KV cache (%s): %d blocks x %d "
        "tokens = %d tokens; max concurrency at max_model_len=%d: %.2fx%s%s",
        pagedllm.__version__, ", ".join(_served_names(args)), url, info.model,
        info.dtype, info.device, info.kv_cache_dtype, info.num_kv_blocks, info.block_size,
        info.num_kv_tokens, info.max_model_len, info.max_concurrency,
        "; API key required" if args.api_key else "",
        f"; {count} API server processes" if count > 1 else "",
    )
    defaults = config.model_config.sampling_defaults
    if defaults:
        logger.info("Requests that do not set them sample with %s (--generation-config %s, "
                    "--override-generation-config; --generation-config none turns them off)",
                    ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())),
                    config.model_config.generation_config)
    if not args.disable_web_ui:
        logger.info("Playground: open %s in a browser", url)
    context = multiprocessing.get_context("spawn")
    others = [context.Process(target=_run_attached, name=f"pagedllm-api-server-{index}",
                              args=(args, config, engine.core_handle(index), sock, metrics_dir,
                                    log_level))
              for index in range(1, count)]
    for process in others:
        process.start()
    try:
        return await _serve_app(args, config, engine, metrics, sock, chat_template, others)
    finally:
        _stop_processes(others, args.shutdown_timeout)
        await engine.shutdown()
        sock.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        logger.info("pagedllm server stopped.")


def _served_names(args: argparse.Namespace) -> list[str]:
    return args.served_model_name or [args.model or DEFAULT_MODEL]


def _engine_limits(args: argparse.Namespace) -> dict:
    """The AsyncEngine's limits of one API process (the waiting bound is split between
    the processes)."""
    waiting = args.max_num_waiting
    return {"max_num_waiting": None if waiting is None else waiting // args.api_server_count,
            "request_timeout_s": args.request_timeout, "stream_interval": args.stream_interval}


async def _serve_app(args: argparse.Namespace, config, engine: AsyncEngine,
                     metrics: ServerMetrics, sock: socket.socket, chat_template: str | None,
                     others: list[multiprocessing.Process], attached: bool = False) -> int:
    """Serve HTTP on ``sock`` until SIGTERM/SIGINT, the core's death (status 1), the exit
    of another API process (``others``, process 0 only; status 1 unless it exited 0), or,
    in an ``attached`` process, the death of process 0 (status 1). Returns the exit status."""
    models = OpenAIServingModels(_served_names(args), str(config.model_config.path),
                                 config.model_config.max_model_len)
    app = build_app(engine, models, metrics, chat_template, args.api_key,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                    web_ui=not args.disable_web_ui,
                    limits=RequestLimits(max_request_body_bytes=args.max_request_body_bytes,
                                         max_n=args.max_n,
                                         max_stop_sequences=args.max_stop_sequences),
                    cors={"allow_origins": args.allowed_origins,
                          "allow_methods": args.allowed_methods,
                          "allow_headers": args.allowed_headers,
                          "allow_credentials": args.allow_credentials})
    gc_tuning.tune_for_serving()
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
    ))

    exit_code = 0

    def stop(message: str, status: int = 1) -> None:
        nonlocal exit_code
        exit_code = exit_code or status
        (logger.error if status else logger.info)(
            "%s: the server stops and exits with status %d.", message, status)
        server.should_exit = True

    engine.on_dead = lambda error: stop("The engine core is dead")
    info = engine.info
    metrics.on_engine_ready(KVCacheShape(dtype=info.kv_cache_dtype, num_blocks=info.num_kv_blocks,
                                         block_size=info.block_size))
    tasks = []
    if others or attached:  # several API processes
        parent = multiprocessing.parent_process() if attached else None
        tasks.append(asyncio.get_running_loop().create_task(
            _watch(others, parent, stop, metrics, lambda: server.should_exit)))
    if not args.disable_log_stats and not attached:
        tasks.append(asyncio.get_running_loop().create_task(
            _log_stats(StatsLogger(metrics), args.log_stats_interval)))

    # uvicorn re-raises the signal that stopped it once it is done; these handlers make that
    # a no-op, so a graceful shutdown ends with status 0 instead of death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in tasks:
            task.cancel()
    return exit_code


async def _watch(others: list[multiprocessing.Process], parent, stop,
                 metrics: ServerMetrics, exiting) -> None:
    """Every half second: stop if another API process exited (process 0) or process 0
    (``parent``, in an attached process) died; refresh this process's share of the
    metrics. Once this server is ``exiting()``, SIGTERM the ``others``, so they finish
    their requests while this one finishes its own."""
    while True:
        await asyncio.sleep(0.5)
        metrics.refresh_tracked_requests()
        if exiting():
            _signal_once(others)
            return
        for process in others:
            if not process.is_alive():
                stop(f"API server process {process.name} exited with code {process.exitcode}",
                     status=1 if process.exitcode else 0)
                return
        if parent is not None and not parent.is_alive():
            stop("API server process 0 is gone")
            return


def _signal_once(processes: list[multiprocessing.Process]) -> None:
    """SIGTERM each live process that has not had it (a second one would make uvicorn
    drop its in-flight requests)."""
    for process in processes:
        if process.is_alive() and not getattr(process, "terminated", False):
            process.terminated = True
            process.terminate()


def _stop_processes(processes: list[multiprocessing.Process], timeout_s: float) -> None:
    """SIGTERM each (once; they finish in-flight requests for up to ``timeout_s``), then
    kill what is left."""
    _signal_once(processes)
    deadline = time.monotonic() + timeout_s + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(1.0)


def _run_attached(args: argparse.Namespace, config, handle: CoreHandle, sock: socket.socket,
                  metrics_dir: str, log_level: str) -> None:
    """Entry point of API process ``handle.index`` (spawned by process 0): serve on the
    shared socket through the running core; exits 1 if the core or process 0 dies."""
    logging.basicConfig(level=log_level,
                        format=f"%(levelname)s %(name)s [api server {handle.index}]: %(message)s")

    async def main() -> int:
        metrics = ServerMetrics(_served_names(args)[0], compat=args.metrics_compat,
                                multiprocess_dir=metrics_dir)
        engine = await AsyncEngine.attach(config, handle, metrics, **_engine_limits(args))
        try:
            return await _serve_app(args, config, engine, metrics, sock,
                                    load_chat_template(args.chat_template), [], attached=True)
        finally:
            await engine.shutdown()

    sys.exit(event_loop.run(main()))


async def _log_stats(stats_logger: StatsLogger, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        stats_logger.maybe_log()


def run(args: argparse.Namespace) -> int:
    """Synchronous entry point (uses uvloop when installed)."""
    return event_loop.run(serve(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedllm.entrypoints.openai.api_server",
        description="The pagedllm OpenAI-compatible server (same flags as `pagedllm serve`).",
        formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR.")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
