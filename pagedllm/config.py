"""Engine configuration: small dataclasses, validated once, with errors that say what to change.

Torch-free on purpose: the core reads ``CacheConfig`` and ``SchedulerConfig``. Only a CUDA
device makes ``EngineConfig`` import torch, to check that this torch can run on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.quantization.checkpoint import (
    QuantizationConfig,
    check_quantization,
    resolve_quantization,
)

_SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "fp32": "float32"}
BUNDLED_MODELS_DIR = Path(__file__).parent / "model_files"
BUILTIN_CONFIGS_DIR = Path(__file__).parent / "model_configs"
DEFAULT_MODEL = "pagedllm-demo"
# Any of these in a model directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEVICES = ("cpu", "cuda")
DEVICE_ENV = "PAGEDLLM_DEVICE"
# ``--kv-cache-dtype``: "auto" stores K/V in the model's dtype, "fp8" as float8_e4m3fn.
KV_CACHE_DTYPES = ("auto", "fp8")
_KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}
# Compute capability whose Triton kernels cast to and from float8_e4m3fn (Ada, Hopper).
FP8_MIN_CAPABILITY = (8, 9)
# generation_config.json's fields that give a request's sampling defaults (vLLM's set), and
# the SamplingParams field each one sets.
GENERATION_DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                             "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                             "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_FILE = "generation_config.json"


def builtin_model_configs() -> list[str]:
    """Names of the built-in benchmark configs (``--model NAME --load-format dummy``)."""
    return sorted(p.name for p in BUILTIN_CONFIGS_DIR.glob("*") if (p / "config.json").is_file())


def resolve_model_path(model: str | None, revision: str | None = None,
                       local_files_only: bool = False) -> Path:
    """Map a model argument to a local directory holding config.json.

    ``None`` is the bundled demo model; a name of a bundled model or of a built-in benchmark
    config (``llama-3.1-8b``, used with ``load_format="dummy"``) resolves inside the
    package; an existing directory is used as is; anything else is a Hugging Face hub id,
    fetched through huggingface_hub's cache (``HF_HUB_OFFLINE=1`` is honoured; with
    ``local_files_only`` nothing is downloaded and a model not in the cache is a ValueError).
    """
    name = model or DEFAULT_MODEL
    for root in (BUNDLED_MODELS_DIR, BUILTIN_CONFIGS_DIR):
        candidate = root / name
        if (candidate / "config.json").is_file():
            return candidate
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"Model directory {path} has no config.json.")
        return path
    if path.exists():
        raise ValueError(f"Model path {path} is a file; pass the directory that holds config.json.")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            name, revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"],
            local_files_only=local_files_only,
        )
    except Exception as exc:  # network off, repo missing, offline cache empty...
        bundled = sorted(p.name for p in BUNDLED_MODELS_DIR.glob("*") if p.is_dir())
        raise ValueError(
            f"Could not find model {name!r}: it is not a local directory and could not be "
            f"fetched from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            f"Bundled models: {bundled}."
        ) from exc
    return Path(local)


def merge_overrides(config: dict, overrides: dict) -> dict:
    """``config`` with ``overrides`` applied: a key's value replaces the config's, an object
    merges into the config's object of that key the same way, and ``None`` removes it."""
    merged = dict(config)
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def _normalize_dtype(dtype: str) -> str:
    dtype = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if dtype.startswith("torch."):
        dtype = dtype[len("torch."):]
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {dtype!r}.")
    return dtype


@dataclass
class ModelConfig:
    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    # "auto" (safetensors) | "dummy" (random weights, real shape) | "bitsandbytes" (vLLM's
    # name for loading bitsandbytes weights: "auto" with bitsandbytes quantization).
    load_format: str = "auto"
    revision: str | None = None
    tokenizer: str | None = None
    # Token-id mode: no tokenizer is loaded; prompts are token ids and outputs carry no text.
    # Turned on automatically for a model directory that ships no tokenizer (the built-in
    # benchmark configs).
    skip_tokenizer_init: bool = False
    # Never capture CUDA graphs; every step runs the model eagerly.
    enforce_eager: bool = False
    # "fp8": decoder projections quantized to FP8 at load (pagedllm.quantization.fp8), or
    # the method a quantized checkpoint declares (compressed-tensors, gptq, awq; with
    # load_format "dummy" gptq/awq give random 4-bit weights); None: the checkpoint's own.
    quantization: str | None = None
    # config.json fields to override (``merge_overrides``), before anything reads it.
    hf_overrides: dict | None = None
    # Where requests' sampling defaults come from (``generation_defaults``): "auto" (the
    # model's generation_config.json), "none", or a folder holding a generation_config.json;
    # ``override_generation_config`` sets fields of it.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # Derived in __post_init__:
    path: Path = field(init=False)
    hf_config: dict = field(init=False, repr=False)
    # The projections' quantization, from config.json's quantization_config or the flag
    # (then ``quantization`` is its method).
    quant_config: QuantizationConfig | None = field(init=False, repr=False)
    # SamplingParams fields a request that does not set them takes (``generation_defaults``).
    sampling_defaults: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "dummy", "bitsandbytes"):
            raise ValueError(
                "load_format must be 'auto', 'safetensors', 'dummy' or 'bitsandbytes', got "
                f"{self.load_format!r}."
            )
        self.dtype = _normalize_dtype(self.dtype)
        self.quantization = check_quantization(self.quantization)
        self.path = resolve_model_path(self.model, self.revision)
        overrides = self.hf_overrides or {}
        self.hf_config = merge_overrides(read_hf_config(self.path), overrides)
        cfg = self.hf_config
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            # The text model's fields at the top, the overrides' top-level ones over them.
            cfg = merge_overrides({**cfg, **cfg["text_config"]}, overrides)
            self.hf_config = cfg
        self.quant_config = resolve_quantization(self.quantization, cfg, self.load_format)
        self.quantization = self.quant_config.method if self.quant_config else None
        if self.load_format == "bitsandbytes":
            if self.quantization != "bitsandbytes":
                raise ValueError(
                    "--load-format bitsandbytes (load_format='bitsandbytes') loads bitsandbytes "
                    "weights: a bitsandbytes checkpoint, or --quantization bitsandbytes to "
                    "quantize this one at load; or drop it (--load-format auto).")
            self.load_format = "auto"
        limit = cfg.get("max_position_embeddings")
        if self.max_model_len is None:
            self.max_model_len = limit or 2048
        elif self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        elif limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}: lower --max-model-len."
            )
        if not self.skip_tokenizer_init and self.tokenizer is None and not any(
            (self.path / name).is_file() for name in TOKENIZER_FILES
        ):
            self.skip_tokenizer_init = True
        self.sampling_defaults = generation_defaults(self.path, self.generation_config,
                                                     self.override_generation_config)

    @property
    def architectures(self) -> list[str]:
        return list(self.hf_config.get("architectures") or [])

    @property
    def num_layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        hf = self.hf_config
        if hf.get("model_type") == "falcon":  # its own fields (see models/gpt_neox.py)
            if hf.get("new_decoder_architecture"):
                return hf.get("num_kv_heads") or self.num_attention_heads
            return 1 if hf.get("multi_query", True) else self.num_attention_heads
        return hf.get("num_key_value_heads") or self.num_attention_heads

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads one tensor-parallel rank holds (and caches): its share, or one
        replicated head when the ranks outnumber them."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    @property
    def head_dim(self) -> int:
        return self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config["vocab_size"]

    @property
    def config_dtype(self) -> str:
        """The dtype the checkpoint declares (``torch_dtype`` or ``dtype``), float32 if none."""
        declared = self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
        return _normalize_dtype(declared)

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.tokenizer) if self.tokenizer else self.path

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence ids declared by the checkpoint itself, for token-id mode:
        generation_config.json's ``eos_token_id`` (an int or a list), else config.json's."""
        generation_config = self.path / GENERATION_CONFIG_FILE
        eos = None
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
        if eos is None:
            eos = self.hf_config.get("eos_token_id")
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)


def generation_defaults(model_path: Path, source: str = "auto",
                        overrides: dict | None = None) -> dict:
    """The sampling defaults of requests that do not set them, as SamplingParams fields:
    ``GENERATION_DEFAULT_FIELDS`` of a generation_config.json (the model's for ``source``
    "auto", none for "none", else the one in the folder ``source``) with ``overrides`` (the
    file's names) set over them, as vLLM's ``--generation-config`` takes them. A ValueError
    that names the flag for a folder without the file, an unknown override or a value
    SamplingParams refuses."""
    from pagedllm.sampling_params import SamplingParams  # torch-free, like this module

    found: dict = {}
    if source != "none":
        folder = model_path if source == "auto" else Path(source).expanduser()
        path = folder / GENERATION_CONFIG_FILE
        if path.is_file():
            found = json.loads(path.read_text())
        elif source != "auto":
            raise ValueError(f"--generation-config {source}: no {GENERATION_CONFIG_FILE} in that "
                             "folder; give 'auto' (the model's), 'none', or a folder holding one.")
    unknown = sorted(set(overrides or {}) - set(GENERATION_DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} is not a sampling "
                         f"default; it takes {', '.join(GENERATION_DEFAULT_FIELDS)}.")
    merged = {**found, **(overrides or {})}
    defaults = {GENERATION_DEFAULT_FIELDS[name]: value for name, value in merged.items()
                if name in GENERATION_DEFAULT_FIELDS and value is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"The sampling defaults of --generation-config {source} ({defaults}) "
                         f"are not valid: {exc} Fix them with --override-generation-config, or "
                         "turn them off with --generation-config none.") from None
    return defaults


# Quantization files of older exports, read when config.json has no quantization_config:
# file -> the method it implies when the file does not name one.
_QUANTIZATION_FILES = (
    ("hf_quant_config.json", "modelopt"),  # NVIDIA Model Optimizer
    ("quantize_config.json", "gptq"),  # AutoGPTQ, GPTQModel (AutoAWQ's fields mean awq)
    ("quant_config.json", "awq"),  # AutoAWQ
)


def read_hf_config(path: Path) -> dict:
    """A checkpoint's config.json; without a ``quantization_config``, the first of the
    older exports' quantization files stands for one (``_QUANTIZATION_FILES``; its own
    ``quant_method`` when it has one, AWQ's when it holds AutoAWQ's ``w_bit`` /
    ``zero_point`` fields)."""
    config = json.loads((path / "config.json").read_text())
    if "quantization_config" in config:
        return config
    for name, method in _QUANTIZATION_FILES:
        if (path / name).is_file():
            declared = json.loads((path / name).read_text())
            if "w_bit" in declared or "zero_point" in declared:
                method = "awq"
            config["quantization_config"] = {"quant_method": method, **declared}
            break
    return config


def normalize_kv_cache_dtype(cache_dtype: str) -> str:
    """``"auto"`` or ``"fp8"`` (``"fp8_e4m3"`` is an alias); ValueError naming the flag otherwise."""
    name = str(cache_dtype).lower()
    name = _KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {cache_dtype} (kv_cache_dtype={cache_dtype!r}) is not supported: "
            "use auto (the model's dtype) or fp8 (alias fp8_e4m3: float8_e4m3fn, half the "
            "bytes of bf16)."
        )
    return name


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 2.0  # CPU only: bytes reserved for the KV cache
    num_kv_blocks: int | None = None  # overrides both sizings when set
    # "auto": K/V in the model's dtype; "fp8": float8_e4m3fn, each layer's K and V divided
    # by its k_scale / v_scale on write and multiplied back on read (layers/attention).
    cache_dtype: str = "auto"
    # GiB of host memory a preempted request's KV is swapped out to (per GPU); 0: a
    # preempted request is computed again.
    swap_space_gb: float = 0.0

    def __post_init__(self) -> None:
        self.cache_dtype = normalize_kv_cache_dtype(self.cache_dtype)
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space_gb}.")


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority" (lower value first, then arrival)
    # Plan and launch step N+1 before reading step N's sampled ids (engine_core.py).
    async_scheduling: bool = False
    # Pipeline stages: up to this many steps in flight, each on other requests (a request
    # is planned again once its step is back; see scheduler.py).
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else self.max_model_len
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_num_seqs)
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}, so a long prompt could never be scheduled "
                "without chunked prefill: raise --max-num-batched-tokens, lower "
                "--max-model-len, or enable chunked prefill."
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Proposers of vLLM-class engines that need weights or heads this engine cannot run.
_UNSUPPORTED_SPECULATIVE_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp",
                                    "deepseek_mtp", "suffix")
# Most tokens one step may propose per request.
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """Speculative decoding: each step a proposer suggests up to ``num_speculative_tokens``
    (K) tokens per decoding request, the target checks them in one forward pass of K + 1
    tokens and keeps the longest run it agrees with plus one token of its own, so every
    step yields 1 to K + 1 tokens with the target's own distribution.

    ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the latest earlier
    occurrence of the request's last n tokens, n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``; no model) or ``"draft_model"`` (``model``: a smaller model with
    the target's vocabulary decodes K tokens ahead; its KV cache lives in the same blocks).
    ``disable_by_batch_size`` (N): a step with more than N running requests speculates for
    none of them. Pure data; ``EngineConfig`` resolves the draft's ``ModelConfig``.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    # Set by ``resolve_draft`` (draft_model only).
    draft_model_config: ModelConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else None
        if self.method in _UNSUPPORTED_SPECULATIVE_METHODS:
            raise ValueError(
                f"Speculative method {self.method!r} is not supported by pagedllm yet: use "
                "--speculative-model DRAFT (method draft_model) or --speculative-method ngram."
            )
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"Speculative decoding needs a proposer: --speculative-model DRAFT or "
                f"--speculative-method ngram (method one of {', '.join(SPECULATIVE_METHODS)}), "
                f"got method={self.method!r}."
            )
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError(
                "Speculative decoding needs --num-speculative-tokens K (tokens proposed per "
                "step, e.g. 4)."
            )
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--num-speculative-tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}."
            )
        if self.method == "draft_model" and self.model is None:
            raise ValueError("The draft_model method needs the draft: --speculative-model PATH_OR_NAME.")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(
                    f"--speculative-method ngram uses no model, but --speculative-model "
                    f"{self.model} was given: drop one of them."
                )
            self.prompt_lookup_max = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            self.prompt_lookup_min = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    "--ngram-prompt-lookup-min and --ngram-prompt-lookup-max must satisfy "
                    f"1 <= min <= max, got min={self.prompt_lookup_min}, "
                    f"max={self.prompt_lookup_max}."
                )
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(
                "--ngram-prompt-lookup-min/max apply to --speculative-method ngram only: drop "
                "them, or use the ngram method."
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"--speculative-disable-by-batch-size must be >= 1, got {self.disable_by_batch_size}."
            )

    def resolve_draft(self, target: ModelConfig) -> None:
        """Load the draft's config (draft_model): its dtype, context and load format follow
        the target's. ValueError when its vocabulary differs from the target's or its
        context is shorter than the target's ``max_model_len``."""
        if self.method != "draft_model":
            return
        try:
            draft = ModelConfig(
                model=self.model, dtype=target.dtype, max_model_len=target.max_model_len,
                seed=target.seed, load_format=target.load_format, skip_tokenizer_init=True,
                enforce_eager=target.enforce_eager,
            )
        except ValueError as exc:
            raise ValueError(f"The draft model --speculative-model {self.model}: {exc}") from exc
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"The draft model {draft.path.name} has a vocabulary of {draft.vocab_size} "
                f"tokens but the target model {target.path.name} has {target.vocab_size}: "
                "speculative decoding needs a draft with the target's vocabulary (the same "
                "tokenizer)."
            )
        self.draft_model_config = draft


def check_device(device: str) -> None:
    """ValueError, saying what to install or change, unless this torch can run on ``device``:
    ``"cpu"``, or ``"cuda"`` with a CUDA build of torch that sees a GPU."""
    if device not in DEVICES:
        raise ValueError(
            f"device must be 'cpu' or 'cuda', got {device!r} (--device, or {DEVICE_ENV} when "
            "--device is not given)."
        )
    if device == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = (f"the installed torch {torch.__version__} is a CPU-only build: install a CUDA "
               "build of torch and triton (https://pytorch.org/get-started/locally/)")
    else:
        why = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check the "
               "NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    raise ValueError(
        f"--device cuda (device='cuda') needs an NVIDIA GPU, but {why}; or run on the CPU "
        "with --device cpu."
    )


def check_fp8_kv_cache_device(device: str) -> None:
    """ValueError unless ``device`` can hold an FP8 KV cache: the CPU (torch casts), or a
    GPU of compute capability 8.9+, where Triton casts float8_e4m3fn (older GPUs cannot)."""
    if device != "cuda":
        return
    import torch

    index = torch.cuda.current_device()
    capability = tuple(torch.cuda.get_device_capability(index))
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or higher (L4, L40S, "
            f"H100, H200), but GPU {index} ({torch.cuda.get_device_name(index)}) has "
            f"{capability[0]}.{capability[1]}: drop --kv-cache-dtype (or pass "
            "--kv-cache-dtype auto)."
        )


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class ParallelConfig:
    """How the model is split over processes (``pagedllm.distributed``).

    ``tensor_parallel_size`` ranks each hold a part of every layer of their pipeline
    stage, and ``pipeline_parallel_size`` stages each hold a run of the decoder layers; the
    engine core drives the ``tp * pp`` ranks through ``distributed_executor_backend``: "mp"
    (worker processes on this host, the default) or "ray" (Ray actors placed on the nodes
    of a Ray cluster, found at ``ray_address``, default ``$RAY_ADDRESS`` or a cluster
    started on this host).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None

    def __post_init__(self) -> None:
        for flag, size in (("--tensor-parallel-size", self.tensor_parallel_size),
                           ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            if size < 1:
                raise ValueError(f"{flag} must be >= 1, got {size}.")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {backend!r}.")
        if backend is None and self.world_size > 1:
            self.distributed_executor_backend = "mp"
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            raise ValueError("--ray-address names a Ray cluster for --distributed-executor-backend "
                             "ray: add that flag, or drop --ray-address.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, model: ModelConfig) -> None:
        """Raise ValueError, saying what to change, when the model cannot be split over
        ``tensor_parallel_size`` ranks: its attention heads, KV heads or MLP width do not
        divide, or its weights are in a format whose split is not implemented."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if pp > model.num_layers:
            raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's "
                             f"{model.num_layers} layers: each stage needs one.")
        if tp == 1:
            return
        heads, kv_heads = model.num_attention_heads, model.num_kv_heads
        hint = "pick a --tensor-parallel-size that divides it"
        if heads % tp:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's "
                             f"{heads} attention heads: {hint}.")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"--tensor-parallel-size {tp} and the model's {kv_heads} KV heads "
                             "neither divide the other: " + hint + " or is a multiple of it.")
        for field in ("intermediate_size", "moe_intermediate_size",
                      "shared_expert_intermediate_size"):
            width = model.hf_config.get(field)
            if width and width % tp:
                raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's MLP "
                                 f"width ({field} {width}): {hint}.")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str = "cpu"
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        check_device(self.device)
        self.parallel_config.check_model(self.model_config)
        parallel = self.parallel_config
        if parallel.pipeline_parallel_size > 1:
            if self.speculative_config is not None:
                raise ValueError("Speculative decoding cannot run with "
                                 "--pipeline-parallel-size > 1 yet: drop one of the two.")
            if not self.scheduler_config.async_scheduling:
                raise ValueError("--pipeline-parallel-size > 1 keeps a step in flight per "
                                 "stage, which is asynchronous scheduling: drop "
                                 "--no-async-scheduling.")
            self.scheduler_config.pipeline_parallel_size = parallel.pipeline_parallel_size
        spec = self.speculative_config
        if spec is not None:
            spec.resolve_draft(self.model_config)
            if spec.draft_model_config is not None:
                try:  # each rank runs its share of the draft too
                    parallel.check_model(spec.draft_model_config)
                except ValueError as exc:
                    raise ValueError(f"The draft model {spec.draft_model_config.path.name}: "
                                     f"{exc}") from None
        if self.cache_config.cache_dtype == "fp8":
            check_fp8_kv_cache_device(self.device)

    @staticmethod
    def default_device() -> str:
        """``$PAGEDLLM_DEVICE`` if set, else cuda when torch sees a GPU, else cpu."""
        forced = os.environ.get(DEVICE_ENV)
        if forced:
            return forced
        try:
            import torch
        except ImportError:  # the core alone
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"
