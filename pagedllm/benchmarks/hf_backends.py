"""The Hugging Face transformers peers of ``bench throughput``, run in the same process on
the same requests.

* ``hf``: ``model.generate`` in static batches (``--hf-batch-size``, default 128) of the
  requests in order, left-padded; a batch generates ``max_new_tokens = min_new_tokens`` =
  its longest output length with EOS disabled, and each request is credited with its own
  output length (tokens past it are the padding waste of static batching).
* ``hf-cb``: transformers' continuous batching (``model.init_continuous_batching``, the
  manager behind ``generate_batch``, on its paged attention), every request submitted at
  once with its own ``max_new_tokens``.

Both sample at temperature 1 (no top-k/top-p), as the pagedllm run does. A peer can be
slow enough to eat a whole benchmark run, so each runs under a time limit: when it is hit,
the run stops, tokens produced so far are counted and the record says ``truncated``.
Model weights are random at the checkpoint's shape (``--load-format dummy``: uniform in
[-1e-3, 1e-3], norms 1, like pagedllm's dummy loader) or the checkpoint's own.

transformers is imported here only, so the engine never depends on it.
"""

from __future__ import annotations

import gc
import inspect
import logging
import time
from pathlib import Path

import torch

from pagedllm.benchmarks.common import SyntheticRequest, reported_seconds

logger = logging.getLogger(__name__)


def load_hf_model(path: Path, load_format: str, dtype: torch.dtype, device: torch.device, seed: int):
    """The checkpoint's transformers model on ``device`` in ``dtype``, in eval mode."""
    import transformers

    if load_format == "dummy":
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        _fill_dummy(model, seed)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore EOS, like --ignore-eos
    return model


@torch.no_grad()
def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    generator = None
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
            continue
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(-1e-3, 1e-3, generator=generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record(backend: str, requests: list[SyntheticRequest], output_tokens: int, elapsed: float,
            truncated: bool, **extra) -> dict:
    elapsed = reported_seconds(elapsed)
    return {
        "backend": backend,
        "num_prompts": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "requested_output_tokens": sum(r.output_len for r in requests),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": round(output_tokens / elapsed, 1) if elapsed > 0 else None,
        "truncated": truncated,
        **extra,
    }


@torch.no_grad()
def run_hf_static(model, requests: list[SyntheticRequest], batch_size: int,
                  time_limit_s: float) -> dict:
    """Static batches through ``generate``; see the module docstring."""
    from transformers import GenerationConfig

    device = model.device
    output_tokens = 0
    truncated = False
    warm = torch.tensor([requests[0].prompt_token_ids[:16]], device=device)
    model.generate(warm, generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=2, min_new_tokens=2, pad_token_id=0, eos_token_id=None))
    _sync(device)
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        remaining = time_limit_s - (time.perf_counter() - start)
        if remaining <= 0:
            truncated = True
            break
        batch = requests[first:first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):  # left padding
            input_ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - len(r.prompt_token_ids):] = 1
        max_new = max(r.output_len for r in batch)
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max_new, min_new_tokens=max_new, max_time=remaining,
            pad_token_id=0, eos_token_id=None,
        )
        out = model.generate(input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=config)
        generated = out.shape[1] - width
        output_tokens += sum(min(r.output_len, generated) for r in batch)
        if generated < max_new:
            truncated = True
            break
    _sync(device)
    elapsed = time.perf_counter() - start
    return _record("hf", requests, output_tokens, elapsed, truncated, batch_size=batch_size)


# Attention implementations to try for continuous batching, in order: the model's own (the
# manager switches to a paged one itself in recent transformers), then the names older
# releases gave paged SDPA.
CB_ATTENTION_CANDIDATES = (None, "paged|sdpa", "sdpa_paged", "paged_attention")


def run_hf_continuous(model, requests: list[SyntheticRequest], time_limit_s: float) -> dict:
    """Continuous batching through the manager behind ``generate_batch``; see the module
    docstring. Tries the attention implementations of ``CB_ATTENTION_CANDIDATES`` until one
    runs (transformers renamed them across releases)."""
    errors = []
    start = time.perf_counter()
    for attn in CB_ATTENTION_CANDIDATES:
        if errors and time.perf_counter() - start > time_limit_s:
            break
        if attn is not None:
            try:
                model.set_attn_implementation(attn)
            except Exception as exc:  # noqa: BLE001 - unknown name in this release
                errors.append(f"{attn}: {type(exc).__name__}: {exc}")
                continue
        try:
            return _run_continuous_once(model, requests, time_limit_s)
        except Exception as exc:  # noqa: BLE001 - try the next implementation
            logger.warning("continuous batching with attention %s failed: %s", attn, exc)
            errors.append(f"{attn or 'default'}: {type(exc).__name__}: {exc}")
    raise RuntimeError("transformers' continuous batching did not run: " + " | ".join(errors))


def _cpu_sizing(model, requests: list[SyntheticRequest]) -> dict:
    """The keyword arguments that size the continuous-batching manager on the CPU: its
    ``workload_hints`` (the longest prompt and output, the request count) and, where this
    transformers takes a ``ContinuousBatchingConfig``, the cache's sizes drawn from the
    same figures. Without them it sizes its static tensors from the host's free memory,
    gigabytes for a toy model (21.8 GB with transformers 5.17), which costs a benchmark on
    a small model most of its time or more memory than the host has. On a GPU the manager sizes from the
    device's memory as a user's run does, and gets no hints (so GPU figures stay
    comparable across runs)."""
    if model.device.type != "cpu":
        return {}
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return {}
    params = inspect.signature(model.init_continuous_batching).parameters
    if "workload_hints" not in params:
        return {}
    longest_prompt = max(len(r.prompt_token_ids) for r in requests)
    longest_output = max(r.output_len for r in requests)
    hints = {"workload_hints": WorkloadHints(max_prompt_length=longest_prompt,
                                             max_generated_length=longest_output,
                                             num_requests=len(requests))}
    if "continuous_batching_config" in params:
        # Releases from 5.17 size the cache from free memory despite the hints: give the
        # sizes (every request's blocks at once, and a step of at most one whole prompt).
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        block_size = ContinuousBatchingConfig().block_size
        blocks_per_request = -(-(longest_prompt + longest_output) // block_size)
        hints["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=(len(requests) + 1) * blocks_per_request,
            max_batch_tokens=max(longest_prompt, 256))
    return hints


@torch.no_grad()
def _run_continuous_once(model, requests: list[SyntheticRequest], time_limit_s: float) -> dict:
    """One run; on the time limit, tokens of unfinished requests are counted when the
    manager exposes them, else only finished requests count (``count`` says which)."""
    from transformers import GenerationConfig

    device = model.device
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=max(r.output_len for r in requests), pad_token_id=0, eos_token_id=None,
    )
    manager = model.init_continuous_batching(generation_config=config,
                                             **_cpu_sizing(model, requests))
    add_params = inspect.signature(manager.add_request).parameters
    finished: dict[str, int] = {}
    count = "finished requests"
    in_flight = None
    manager.start()
    try:
        # One short request first: the manager sizes and allocates its paged cache on its
        # first step, start-up cost that stays out of the timing (as pagedllm's does).
        manager.add_request(requests[0].prompt_token_ids[:16], request_id="warm-up",
                            max_new_tokens=2)
        warm_deadline = time.perf_counter() + 30
        while (result := manager.get_result(timeout=1.0)) is None or not result.is_finished():
            if (result is None and not manager.is_running()) or time.perf_counter() > warm_deadline:
                raise RuntimeError("the continuous batching loop did not start.")
        if getattr(result, "error", None):
            raise RuntimeError(f"the warm-up request failed: {result.error}")
        _sync(device)
        start = time.perf_counter()
        for i, r in enumerate(requests):
            kwargs = {"request_id": f"req_{i}", "max_new_tokens": r.output_len}
            if "eos_token_id" in add_params:
                kwargs["eos_token_id"] = -1
            manager.add_request(r.prompt_token_ids, **kwargs)
        deadline = start + time_limit_s
        while len(finished) < len(requests) and time.perf_counter() < deadline:
            result = manager.get_result(timeout=0.5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching loop stopped early.")
                continue
            if result.is_finished():
                if getattr(result, "error", None):
                    raise RuntimeError(f"a request failed: {result.error}")
                finished[result.request_id] = len(result.generated_tokens)
        elapsed = time.perf_counter() - start
        truncated = len(finished) < len(requests)
        if truncated:
            in_flight = _tokens_in_flight(manager, set(finished))
            if in_flight is not None:
                count = "finished requests + tokens of those in flight"
    finally:
        stopped = _stop(manager, [f"req_{i}" for i in range(len(requests))], set(finished))
    output_tokens = sum(finished.values()) + (in_flight or 0)
    attn = getattr(model.config, "_attn_implementation", None)
    extra = {} if stopped else {"warning": "the HF generation thread outlived stop()"}
    return _record("hf-cb", requests, output_tokens, elapsed, truncated,
                   attn_implementation=attn, count=count, **extra)


def _stop(manager, request_ids: list[str], finished: set[str]) -> bool:
    """Stop the manager without finishing the requests still queued or running (they would
    keep the GPU busy during the next benchmark); True when its thread has ended."""
    if hasattr(manager, "cancel_request"):
        for request_id in request_ids:
            if request_id not in finished:
                try:
                    manager.cancel_request(request_id)
                except Exception:  # noqa: BLE001 - already gone
                    pass
    kwargs = {"block": True, "timeout": 30}
    if "hard_stop" in inspect.signature(manager.stop).parameters:
        kwargs["hard_stop"] = True
    manager.stop(**kwargs)
    thread = getattr(manager, "_generation_thread", None)
    alive = thread is not None and thread.is_alive()
    if alive:
        logger.warning("transformers' generation thread is still running after stop().")
    return not alive


def _tokens_in_flight(manager, finished: set[str]) -> int | None:
    """Tokens generated so far by unfinished requests, read from the manager's scheduler
    (an internal structure: None when this transformers version lays it out otherwise)."""
    try:
        states = manager.batch_processor.scheduler.active_requests
        return sum(len(s.generated_tokens) for rid, s in states.items() if rid not in finished)
    except Exception:  # noqa: BLE001 - best effort across transformers versions
        return None


def run_hf_backends(backends: list[str], model_path: Path, load_format: str, dtype: torch.dtype,
                    device: torch.device, seed: int, requests: list[SyntheticRequest],
                    batch_size: int, time_limit_s: float, on_record) -> None:
    """Load the HF model once, run each peer in ``backends`` and hand each record to
    ``on_record``; the model is freed before returning."""
    try:
        model = load_hf_model(model_path, load_format, dtype, device, seed)
    except Exception as exc:  # noqa: BLE001 - the pagedllm run must still happen
        logger.exception("loading the HF model failed")
        for backend in backends:
            on_record({"backend": backend, "num_prompts": len(requests),
                       "error": f"loading the model: {type(exc).__name__}: {exc}"})
        return
    try:
        for backend in backends:
            logger.info("Running %s on %d requests (time limit %.0f s)", backend,
                        len(requests), time_limit_s)
            try:
                if backend == "hf":
                    record = run_hf_static(model, requests, batch_size, time_limit_s)
                else:
                    record = run_hf_continuous(model, requests, time_limit_s)
            except Exception as exc:  # noqa: BLE001 - one failing peer must not sink the others
                logger.exception("%s failed", backend)
                record = {"backend": backend, "num_prompts": len(requests),
                          "error": f"{type(exc).__name__}: {exc}"}
            on_record(record)
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
