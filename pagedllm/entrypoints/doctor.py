"""``pagedllm doctor [serve flags]``: check a setup before serving it.

Takes the flags of ``pagedllm serve`` and prints one line per check, PASS, WARN, FAIL or
SKIP (not applicable), with the fix under every WARN and FAIL:

- flags: the serve flags are valid (what ``serve`` refuses, doctor fails);
- gpu: torch sees a GPU, with the compute capability the requested features need
  (``--quantization fp8``: 8.9+ for FP8 tensor cores; bfloat16: 8.0+); none is a WARN
  (the CPU reference paths serve), and FAIL when ``--device cuda`` asks for one;
  ``--kv-cache-dtype fp8`` on a GPU below 8.9 is a FAIL (serve refuses it);
- model: config.json and weights are on disk or in the Hugging Face cache; a model that is
  not cached is a WARN (serve downloads it), a FAIL with ``HF_HUB_OFFLINE`` set;
- tokenizer, chat template, tool parser: a missing template is a WARN (chat endpoints then
  answer 400), as is a ``--tool-call-parser`` whose markers the template never mentions;
- shm: the size of ``/dev/shm`` (WARN under 1 GiB; FAIL under it with
  ``--tensor-parallel-size`` above 1 on GPUs); nccl: enough GPUs for
  ``--tensor-parallel-size`` and peer-to-peer access between them;
- port: a bind test on ``--host``/``--port``;
- swap space: ``--swap-space`` (per GPU, so times ``--tensor-parallel-size``) within the
  host memory available now (FAIL beyond it: serve refuses it; WARN above 70% of it);
- kv cache: whether ``--max-num-seqs`` requests of ``--max-model-len`` tokens fit the KV
  budget, with the largest concurrency and ``--max-model-len`` that fit, from the engine's
  own sizing functions (``worker/kv_allocator.py``), in the cache's element size (one
  byte with ``--kv-cache-dtype fp8``). On a GPU the budget is
  ``--gpu-memory-utilization`` of its memory less the weights (parameters x dtype bytes from
  config.json); the engine also subtracts the activations of its largest step and the CUDA
  graphs, measured at start, so its cache is a little smaller. On the CPU it is
  ``--kv-cache-memory-gb``.

Exit status: 0 when no check fails (with ``--strict``: none warns either), 1 otherwise.
Doctor reads config and tokenizer files only; it loads no weights and downloads nothing.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pagedllm.config import FP8_MIN_CAPABILITY, normalize_kv_cache_dtype

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
from pagedllm.distributed.checks import MIN_SHM_BYTES as SHM_MIN_BYTES
from pagedllm.distributed.checks import SHM_PATH, shm_problem, shm_size
from pagedllm.worker.kv_allocator import host_memory_available, swap_space_problem
BF16_MIN_CAPABILITY = (8, 0)
_GIB = 1 << 30


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _tool_call_markers() -> dict[str, tuple[str, ...]]:
    """Per ``--tool-call-parser``: text a chat template that prompts for that call format
    mentions (any one suffices)."""
    from pagedllm.entrypoints.openai.tool_parsers import hermes, llama3_json, mistral

    return {
        "hermes": (hermes.START,),
        "llama3_json": (llama3_json.PYTHON_TAG, '"parameters"'),
        "mistral": (mistral.TOOL_CALLS,),
        "pythonic": ("[func_name",),
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    add_serve_args(parser)
    parser.add_argument("--strict", action="store_true",
                        help="Exit 1 on a WARN too (default: only a FAIL does).")


# -- the checks ---------------------------------------------------------------------------
def check_flags(args: argparse.Namespace) -> Check:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.cli_args import validate_serve_args

    try:
        validate_serve_args(args)
        EngineArgs.from_cli_args(args)
        normalize_kv_cache_dtype(args.kv_cache_dtype)
    except (ValueError, TypeError) as exc:
        return Check("flags", FAIL, str(exc), "change the flag as the message says")
    return Check("flags", PASS, "the serve flags are valid")


def _requested_device(args: argparse.Namespace) -> str | None:
    from pagedllm.config import DEVICE_ENV

    return args.device or os.environ.get(DEVICE_ENV) or None


def check_gpu(args: argparse.Namespace, cuda) -> Check:
    """``cuda`` is ``torch.cuda`` (a stand-in in tests)."""
    fp8 = args.quantization == "fp8"
    fp8_kv = _kv_cache_dtype(args) == "fp8"
    requested = _requested_device(args)
    if not cuda.is_available():
        if requested == "cuda":
            from pagedllm.config import check_device

            try:
                check_device("cuda")
            except ValueError as exc:
                return Check("gpu", FAIL, str(exc), "fix the driver or torch build, or pass "
                             "--device cpu")
        detail = "no GPU visible to torch: the model runs on the CPU (torch reference paths)"
        if fp8:
            detail += "; --quantization fp8 runs its float32 reference path there"
        return Check("gpu", WARN, detail, "on a GPU host: install a CUDA build of torch and "
                     "check nvidia-smi and CUDA_VISIBLE_DEVICES; on the CPU this is expected")
    if requested == "cpu":
        return Check("gpu", PASS, f"{cuda.device_count()} GPU(s) visible; --device cpu keeps "
                     "the model on the CPU")
    gpus, problems, refused = [], [], []
    bf16 = _resolved_dtype_name(args, "cuda") == "bfloat16"
    for index in range(cuda.device_count()):
        capability = tuple(cuda.get_device_capability(index))
        gpus.append(f"{index}: {cuda.get_device_name(index)} (compute capability "
                    f"{capability[0]}.{capability[1]})")
        if fp8 and capability < FP8_MIN_CAPABILITY:
            problems.append(f"GPU {index} has compute capability {capability[0]}.{capability[1]}"
                            ": --quantization fp8 needs 8.9+ for FP8 tensor cores and runs a "
                            "float32 reference path here (slow)")
        if fp8_kv and capability < FP8_MIN_CAPABILITY:
            refused.append(f"GPU {index} has compute capability {capability[0]}.{capability[1]}"
                           ": --kv-cache-dtype fp8 needs 8.9+ (serve refuses to start)")
        if bf16 and capability < BF16_MIN_CAPABILITY:
            problems.append(f"GPU {index} has compute capability {capability[0]}.{capability[1]}"
                            ": bfloat16 needs 8.0+")
    detail = "GPU " + "; ".join(gpus)
    if refused:
        return Check("gpu", FAIL, detail + ". " + "; ".join(refused + problems),
                     "use a GPU of compute capability 8.9+ (L4, L40S, H100, H200), or drop "
                     "--kv-cache-dtype fp8")
    if problems:
        return Check("gpu", WARN, detail + ". " + "; ".join(problems),
                     "use a GPU of compute capability 8.9+ (L4, L40S, H100, H200) for fp8, or "
                     "--dtype float16 on one below 8.0")
    return Check("gpu", PASS, detail)


def _kv_cache_dtype(args: argparse.Namespace) -> str:
    """``--kv-cache-dtype`` normalized (``fp8_e4m3`` is ``fp8``); as given when invalid (the
    flags check reports it)."""
    try:
        return normalize_kv_cache_dtype(args.kv_cache_dtype)
    except ValueError:
        return args.kv_cache_dtype


def _resolved_dtype_name(args: argparse.Namespace, device: str, hf_config: dict | None = None) -> str:
    """The dtype the engine runs in (``models/loader.py``'s rule: an explicit ``--dtype``
    wins; "auto" is the checkpoint's, float32 for half-precision checkpoints on the CPU)."""
    from pagedllm.config import _normalize_dtype

    if args.dtype != "auto":
        return _normalize_dtype(args.dtype)
    if hf_config is None:
        return "auto"
    declared = _normalize_dtype(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    if device == "cpu" and declared in ("float16", "bfloat16"):
        return "float32"
    return declared


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def check_model(args: argparse.Namespace) -> tuple[Check, Path | None]:
    """The model check and the model's local directory (None when it is not on disk)."""
    from pagedllm.config import DEFAULT_MODEL, resolve_model_path

    name = args.model or args.model_tag or DEFAULT_MODEL
    try:
        path = resolve_model_path(name, args.revision, local_files_only=True)
    except ValueError as exc:
        if Path(name).expanduser().exists():  # a local path that is not a model directory
            return Check("model", FAIL, str(exc).split(" Bundled")[0],
                         "pass the directory that holds config.json"), None
        if _hub_offline():
            return Check("model", FAIL, f"{name} is not in the Hugging Face cache and "
                         "HF_HUB_OFFLINE is set, so serve cannot fetch it",
                         f"download it where the network is reachable (huggingface-cli "
                         f"download {name}) into this HF_HOME, or unset HF_HUB_OFFLINE"), None
        return Check("model", WARN, f"{name} is not in the Hugging Face cache: serve downloads "
                     "it at start (the checks that need its files are skipped)",
                     f"download it first (huggingface-cli download {name}; gated models "
                     "need HF_TOKEN) so the start is fast and these checks run"), None
    if args.load_format == "dummy":
        return Check("model", PASS, f"{path}: config.json (random weights, --load-format "
                     "dummy)"), path
    shards = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        listed = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [shard for shard in listed if not (path / shard).is_file()]
        if missing:
            return Check("model", FAIL, f"{path}: {len(missing)} of the {len(listed)} weight "
                         f"shards its index lists are missing ({', '.join(missing[:3])})",
                         "download the model again (an interrupted download leaves shards "
                         "out)"), path
    if not shards:
        return Check("model", FAIL, f"{path} has config.json but no *.safetensors weights",
                     "download the weights, or pass --load-format dummy for random weights "
                     "at the model's shape"), path
    size = sum(shard.stat().st_size for shard in shards)
    return Check("model", PASS, f"{path}: config.json and {len(shards)} safetensors "
                 f"file(s), {size / _GIB:.2f} GiB"), path


def _tokenizer_dir(args: argparse.Namespace, model_dir: Path | None) -> Path | None:
    from pagedllm.config import TOKENIZER_FILES

    if args.skip_tokenizer_init:
        return None
    directory = Path(args.tokenizer).expanduser() if args.tokenizer else model_dir
    if directory is None or not any((directory / f).is_file() for f in TOKENIZER_FILES):
        return None
    return directory


def check_tokenizer(args: argparse.Namespace, model_dir: Path | None) -> Check:
    if args.skip_tokenizer_init:
        return Check("tokenizer", PASS, "--skip-tokenizer-init: token-id mode")
    if model_dir is None and not args.tokenizer:
        return Check("tokenizer", SKIP, "the model is not on disk")
    if _tokenizer_dir(args, model_dir) is None:
        where = args.tokenizer or model_dir
        if args.tokenizer:
            return Check("tokenizer", FAIL, f"--tokenizer {where} holds no tokenizer files",
                         "pass a directory with tokenizer.json (or tokenizer_config.json)")
        return Check("tokenizer", WARN, f"{where} has no tokenizer: the server runs in "
                     "token-id mode (text prompts and chat answer 400)",
                     "pass --tokenizer DIR (the model's tokenizer) to serve text")
    return Check("tokenizer", PASS, f"tokenizer files in {_tokenizer_dir(args, model_dir)}")


def _chat_template(args: argparse.Namespace, tokenizer_dir: Path) -> str | dict | None:
    from pagedllm.engine.tokenizer import TOKENIZER_CONFIG_FILE, _load_chat_template
    from pagedllm.entrypoints.openai.serving_chat import load_chat_template

    config_file = tokenizer_dir / TOKENIZER_CONFIG_FILE
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    own = _load_chat_template(tokenizer_dir, config)
    given = load_chat_template(args.chat_template)
    if given is None:
        return own
    if isinstance(own, dict) and given in own:
        return own[given]
    return given


def check_chat_template(args: argparse.Namespace, model_dir: Path | None) -> list[Check]:
    tokenizer_dir = _tokenizer_dir(args, model_dir)
    if tokenizer_dir is None:
        return [Check("chat template", SKIP, "no tokenizer: chat is not served")]
    try:
        template = _chat_template(args, tokenizer_dir)
    except ValueError as exc:
        return [Check("chat template", FAIL, str(exc), "fix --chat-template")]
    if not template:
        return [Check("chat template", WARN, "the model has no chat template: "
                      "/v1/chat/completions answers 400 (completions work)",
                      "pass --chat-template FILE (a Jinja template)")]
    text = "\n".join(template.values()) if isinstance(template, dict) else template
    checks = [Check("chat template", PASS, "the model's chat template" if not args.chat_template
                    else f"--chat-template {args.chat_template}")]
    parser = args.tool_call_parser
    markers = _tool_call_markers().get(parser) if parser else None
    if markers is None:
        return checks
    if "tools" not in text:
        checks.append(Check("tool parser", WARN, "the chat template never reads `tools`: the "
                            "model is not told which tools it may call",
                            "pass a --chat-template that renders the tools"))
    elif not any(marker in text for marker in markers):
        checks.append(Check("tool parser", WARN, f"--tool-call-parser {parser} reads calls "
                            f"marked {' or '.join(markers)}, but the chat template never "
                            "mentions them: the model is probably prompted for another format",
                            "pick the parser of the model's format (hermes: <tool_call>, "
                            "llama3_json: <|python_tag|> / \"parameters\", mistral: "
                            "[TOOL_CALLS], pythonic: [func(...)]), or pass a --chat-template "
                            "that asks for this one"))
    else:
        checks.append(Check("tool parser", PASS, f"the chat template mentions "
                            f"{' or '.join(m for m in markers if m in text)}"))
    return checks


def check_shm(args: argparse.Namespace, path: str = SHM_PATH) -> Check:
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    size = shm_size(path)
    if size is None:
        return Check("shm", WARN, f"{path} does not exist: PyTorch shares tensors between "
                     "processes through it", "mount a tmpfs on /dev/shm (--ipc=host in Docker)")
    detail = f"{path} is {size / _GIB:.2f} GiB"
    problem = shm_problem(size, tp) if tp > 1 else None
    if problem is not None:
        return Check("shm", FAIL, problem, "run the container with --ipc=host or "
                     "--shm-size=16g (Kubernetes: a memory-backed emptyDir on /dev/shm)")
    if size < SHM_MIN_BYTES:
        return Check("shm", WARN, detail + ", under 1 GiB: a process that runs out of it dies "
                     "with a bus error", "run the container with --ipc=host or "
                     "--shm-size=8g (Kubernetes: a memory-backed emptyDir on /dev/shm)")
    return Check("shm", PASS, detail)


def check_swap_space(args: argparse.Namespace, available: int | None) -> Check:
    """``--swap-space`` on every rank against the ``available`` bytes of host memory (None
    when the host does not say)."""
    swap_gb = getattr(args, "swap_space", 0) or 0
    if not swap_gb:
        return Check("swap space", SKIP, "--swap-space 0: a preempted request is computed "
                     "again")
    ranks = getattr(args, "tensor_parallel_size", 1) or 1
    wanted = swap_gb * _GIB * ranks
    detail = (f"--swap-space {swap_gb:g} GiB x {ranks} rank(s) = {wanted / _GIB:.1f} GiB of "
              "page-locked host memory")
    if available is None:
        return Check("swap space", WARN, detail + "; the host does not say how much is free",
                     "check the free memory (free -g) before serving")
    problem = swap_space_problem(swap_gb, available, ranks)
    if problem is not None:
        return Check("swap space", FAIL, problem, "lower --swap-space, or free host memory")
    detail += f", of {available / _GIB:.1f} GiB available"
    if wanted > 0.7 * available:
        return Check("swap space", WARN, detail + ": little is left for the rest of the host",
                     "lower --swap-space unless the host serves nothing else")
    return Check("swap space", PASS, detail)


def check_nccl(args: argparse.Namespace, cuda) -> Check:
    """GPUs enough for --tensor-parallel-size on this host, and peer-to-peer access between
    them (``cuda`` is ``torch.cuda``, a stand-in in tests)."""
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    if tp == 1:
        return Check("nccl", SKIP, "--tensor-parallel-size 1: one process uses one GPU")
    if getattr(args, "distributed_executor_backend", None) == "ray":
        return Check("nccl", SKIP, "--distributed-executor-backend ray: Ray places the ranks "
                     "on the cluster's GPUs")
    if not cuda.is_available():
        return Check("nccl", SKIP, f"no GPU: the {tp} ranks run on the CPU (gloo)")
    count = cuda.device_count()
    if count < tp:
        return Check("nccl", FAIL, f"--tensor-parallel-size {tp} needs {tp} GPUs and {count} "
                     "are visible", "lower --tensor-parallel-size, or check "
                     "CUDA_VISIBLE_DEVICES")
    blocked = [(i, j) for i in range(tp) for j in range(tp)
               if i != j and not cuda.can_device_access_peer(i, j)]
    if blocked and os.environ.get("NCCL_P2P_DISABLE") != "1":
        i, j = blocked[0]
        return Check("nccl", WARN, f"GPUs {i} and {j} have no peer-to-peer access: NCCL goes "
                     "through host memory", "if start-up hangs, set NCCL_P2P_DISABLE=1 (slower "
                     "all-reduces, but no hang)")
    return Check("nccl", PASS, f"{tp} GPUs with peer-to-peer access" if not blocked
                 else f"{tp} GPUs; NCCL_P2P_DISABLE=1: all-reduces through host memory")


def check_port(args: argparse.Namespace) -> Check:
    from pagedllm.entrypoints.openai.api_server import _bind

    try:
        _bind(args.host, args.port).close()
    except ValueError as exc:
        return Check("port", FAIL, str(exc).split(": pick")[0],
                     f"pass another --port, or stop the process using it (ss -ltnp 'sport = "
                     f":{args.port}')")
    return Check("port", PASS, f"{args.host}:{args.port} is free")


def check_kv_cache(args: argparse.Namespace, model_dir: Path | None, cuda) -> Check:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.worker import kv_allocator as kv

    if model_dir is None:
        return Check("kv cache", SKIP, "the model is not on disk")
    device = _requested_device(args) or ("cuda" if cuda.is_available() else "cpu")
    if device == "cuda" and not cuda.is_available():
        return Check("kv cache", SKIP, "--device cuda but no GPU is visible")
    try:
        engine_args = EngineArgs.from_cli_args(argparse.Namespace(
            **{**vars(args), "model": str(model_dir)}))
        engine_args.device = "cpu"  # the GPU itself is the gpu check's; the sizing is below
        config = engine_args.create_engine_config()
    except (ValueError, TypeError) as exc:
        return Check("kv cache", FAIL, str(exc), "change the flag as the message says")
    model, cache = config.model_config, config.cache_config
    block_size, max_model_len = cache.block_size, model.max_model_len
    dtype = _resolved_dtype_name(args, device, model.hf_config)
    element = kv.DTYPE_BYTES[dtype]
    # A draft model's K/V share each block with the target's (speculative decoding).
    spec = config.speculative_config
    draft = spec.draft_model_config if spec is not None else None
    models = [model] if draft is None else [model, draft]
    # With parallelism: one rank's share of the weights, of the KV heads (tensor-parallel)
    # and of the layers (the largest pipeline stage's).
    tp, pp = (config.parallel_config.tensor_parallel_size,
              config.parallel_config.pipeline_parallel_size)
    per_block = sum(kv.block_bytes(num_layers=-(-m.num_layers // pp), block_size=block_size,
                                   num_kv_heads=m.kv_heads_per_rank(tp), head_dim=m.head_dim,
                                   element_size=kv.kv_element_size(cache.cache_dtype, dtype))
                    for m in models)
    if cache.num_kv_blocks is not None:
        available, source = cache.num_kv_blocks * per_block, f"--num-kv-blocks {cache.num_kv_blocks}"
    elif device == "cuda":
        _, total = cuda.mem_get_info(0)
        storage = model.quant_config.storage() if model.quant_config else (None, -1)
        weights = kv.weight_bytes(model.hf_config, element, *storage)
        if draft is not None:
            weights += kv.weight_bytes(draft.hf_config, element)
        weights //= tp * pp
        available = kv.gpu_kv_bytes(total, cache.gpu_memory_utilization, weights)
        source = (f"--gpu-memory-utilization {cache.gpu_memory_utilization} of "
                  f"{total / _GIB:.1f} GiB less {weights / _GIB:.2f} GiB of {dtype}"
                  f"{' + ' + storage[0] if storage[0] else ''} weights"
                  f"{f' (one of {tp * pp} ranks)' if tp * pp > 1 else ''}, before "
                  "activations and CUDA graphs")
    else:
        available = kv.cpu_kv_bytes(cache.kv_cache_memory_gb)
        source = f"--kv-cache-memory-gb {cache.kv_cache_memory_gb}"
    blocks = kv.blocks_for_bytes(available, per_block, 1 << 62)
    tokens = blocks * block_size
    limit = model.hf_config.get("max_position_embeddings") or tokens
    largest_len = min(tokens, limit)
    concurrency = kv.max_concurrency(blocks, max_model_len, block_size)
    max_num_seqs = config.scheduler_config.max_num_seqs
    detail = (f"{max(available, 0) / _GIB:.2f} GiB ({source}) hold {tokens} tokens in "
              f"{blocks} blocks of {per_block / 2**20:.2f} MiB"
              f"{' (fp8 KV cache)' if cache.cache_dtype == 'fp8' else ''}"
              f"{' (target and draft model)' if draft is not None else ''}; at --max-model-len "
              f"{max_model_len}, {concurrency} requests fit at once (--max-num-seqs "
              f"{max_num_seqs}); the largest --max-model-len that fits is {largest_len}")
    if concurrency < 1:
        return Check("kv cache", FAIL, detail + ": serve would refuse to start",
                     f"lower --max-model-len to {largest_len} or less, or give the cache more "
                     "memory (--gpu-memory-utilization on a GPU, --kv-cache-memory-gb on the "
                     "CPU)" if largest_len else "give the cache more memory, or use a GPU "
                     "with more memory or --quantization fp8")
    if concurrency < max_num_seqs:
        return Check("kv cache", WARN, detail + f": {max_num_seqs} requests of full length do "
                     "not fit together (shorter ones do; the rest wait or are preempted)",
                     f"lower --max-num-seqs to {concurrency}"
                     + (f" or --max-model-len to {blocks // max_num_seqs * block_size}"
                        if blocks >= max_num_seqs else "")
                     + ", or give the cache more memory")
    return Check("kv cache", PASS, detail)


# -- running ------------------------------------------------------------------------------
def run_checks(args: argparse.Namespace, cuda=None, shm_path: str = SHM_PATH) -> list[Check]:
    if cuda is None:
        import torch

        cuda = torch.cuda
    checks = [check_flags(args)]
    if args.model is None:
        args.model = args.model_tag
    checks.append(check_gpu(args, cuda))
    model_check, model_dir = check_model(args)
    checks.append(model_check)
    checks.append(check_tokenizer(args, model_dir))
    checks.extend(check_chat_template(args, model_dir))
    checks.append(check_shm(args, shm_path))
    checks.append(check_nccl(args, cuda))
    checks.append(check_port(args))
    checks.append(check_swap_space(args, host_memory_available()))
    checks.append(check_kv_cache(args, model_dir, cuda))
    return checks


def exit_code(checks: list[Check], strict: bool = False) -> int:
    failing = {FAIL, WARN} if strict else {FAIL}
    return int(any(check.status in failing for check in checks))


def format_checks(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        lines.append(f"{check.status}  {check.name:<14} {check.detail}")
        if check.fix and check.status in (WARN, FAIL):
            lines.append(f"{'':<6}{'':<14} fix: {check.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, SKIP)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    print(format_checks(checks))
    return exit_code(checks, args.strict)
