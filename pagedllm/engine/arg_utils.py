"""Engine arguments: one definition shared by the offline ``LLM(...)`` and the CLI flags.

Each field is a keyword of ``LLM(...)`` and a ``--kebab-case`` flag of ``pagedllm``. Features
that other parts of the roadmap bring (pipeline parallelism, LoRA) are refused with a clear message instead of being silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields

from pagedllm.config import (
    SPECULATIVE_METHODS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

# vLLM's engine arguments this engine does not implement: name -> (the value that means
# "off", accepted; what to do instead, or ""). Any other value is refused.
_NOT_YET_SUPPORTED = {
    "enable_lora": (False, ""),
    "cpu_offload_gb": (0, ""),
    "download_dir": (None, "set HF_HUB_CACHE=DIR to keep downloaded models in DIR"),
}
# Speculative-decoding fields of EngineArgs -> their keys in --speculative-config.
_SPECULATIVE_FLAGS = {
    "speculative_method": "method",
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
}
# Default token budget of one step on CUDA (chunked prefill on).
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
# Default most requests running at once: on CUDA as many as the largest captured decode
# graph holds (a decode step of 512 reads the weights once for twice the tokens of 256:
# docs/benchmarks.md, the FP8 cache's slot-major values); the CPU keeps the scheduler's.
CUDA_MAX_NUM_SEQS = 512


def _json_object(given: dict | str | None, flag: str, example: str) -> dict | None:
    """A flag's JSON object (or the dict the Python keyword passed); ValueError naming the
    flag when it is not valid JSON or not an object."""
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc}.") from exc
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. {example}.")
    return given


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` of the ``pagedllm`` commands: descriptions keep their layout but lose
    reStructuredText's double backticks, and each option's help ends with its default.

    The default is left out where the help already states it, where it is ``None`` (the
    help says what no value means: "sized", "the model's"...), and for a flag that takes no
    value and is off unless given.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(text.replace("``", ""), width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is argparse.SUPPRESS
                or "default" in text or (default is False and action.nargs == 0)):
            return text
        shown = ("on" if default else "off") if isinstance(default, bool) else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 2.0
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    device: str | None = None
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    # config.json fields to override (a dict, or its JSON from --hf-overrides).
    hf_overrides: dict | str | None = None
    # Requests' sampling defaults: "auto" (the model's generation_config.json), "none", or
    # a folder holding one; and fields set over them (a dict, or JSON).
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # None: on with CUDA (the host prepares a step while the GPU runs the previous one),
    # off on the CPU, where host and model share the same cores and nothing overlaps.
    async_scheduling: bool | None = None
    # Speculative decoding (None: off); the flags and --speculative-config's JSON keys.
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    speculative_method: str | None = None
    ngram_prompt_lookup_min: int | None = None
    ngram_prompt_lookup_max: int | None = None
    speculative_disable_by_batch_size: int | None = None
    speculative_config: dict | str | None = None
    # Parallelism (see ParallelConfig).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None
    # GiB of host memory per GPU that preempted requests' KV is swapped out to (vLLM v0's
    # --swap-space); 0: preemption recomputes.
    swap_space: float = 0.0
    # vLLM's permission to run a model repository's own Python code. pagedllm runs none:
    # every architecture it serves is its own code, so the permission changes nothing.
    trust_remote_code: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        for name, (off, instead) in _NOT_YET_SUPPORTED.items():
            if name in kwargs:
                value = kwargs.pop(name)
                if value != off:
                    flag = "--" + name.replace("_", "-")
                    given = flag if isinstance(value, bool) else f"{flag} {value}"
                    raise ValueError(
                        f"{given} ({name}={value!r}) is not supported by pagedllm yet: drop "
                        f"{flag} (the {name} keyword in Python)"
                        + (f"; {instead}." if instead else ".")
                    )
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"Unknown engine argument(s): {', '.join(unknown)}. "
                f"Known: {', '.join(sorted(known))}."
            )
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, revision=self.revision, dtype=self.dtype,
            load_format=self.load_format, seed=self.seed, max_model_len=self.max_model_len,
            skip_tokenizer_init=self.skip_tokenizer_init, enforce_eager=self.enforce_eager,
            quantization=self.quantization, hf_overrides=self._hf_overrides(),
            generation_config=self.generation_config,
            override_generation_config=_json_object(
                self.override_generation_config, "--override-generation-config",
                '\'{"temperature": 0.7}\''),
        )
        cache_config = CacheConfig(
            block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_gb=self.kv_cache_memory_gb, num_kv_blocks=self.num_kv_blocks,
            cache_dtype=self.kv_cache_dtype, swap_space_gb=self.swap_space,
        )
        device = self.device or EngineConfig.default_device()
        speculative_config = self._speculative_config()
        if self.swap_space and self.pipeline_parallel_size > 1:
            raise ValueError(
                f"--swap-space {self.swap_space} does not work with pipeline stages yet: drop "
                "--swap-space (preempted requests are then computed again), or "
                "--pipeline-parallel-size.")
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            max_num_seqs = CUDA_MAX_NUM_SEQS if device == "cuda" else SchedulerConfig.max_num_seqs
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None and self.enable_chunked_prefill and device == "cuda":
            # A GPU step of 8k tokens keeps the matrix units busy; the CPU keeps the
            # scheduler's smaller default.
            max_num_batched_tokens = max(CUDA_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        scheduler_config = SchedulerConfig(
            max_model_len=model_config.max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill, policy=self.scheduling_policy,
            # Pipeline stages keep steps in flight: asynchronous.
            async_scheduling=(device == "cuda" or self.pipeline_parallel_size > 1
                              if self.async_scheduling is None else self.async_scheduling),
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            ray_address=self.ray_address,
        )
        return EngineConfig(model_config, cache_config, scheduler_config, device=device,
                            speculative_config=speculative_config,
                            parallel_config=parallel_config)

    def _hf_overrides(self) -> dict | None:
        """``hf_overrides`` as a dict (``--hf-overrides`` gives its JSON)."""
        return _json_object(self.hf_overrides, "--hf-overrides",
                            '\'{"max_position_embeddings": 65536}\'') or None

    def _speculative_config(self) -> SpeculativeConfig | None:
        """``--speculative-config`` (a dict, or its JSON text) merged with the individual
        flags; None when neither asks for speculation. A flag and a key that disagree are
        refused."""
        given = _json_object(self.speculative_config, "--speculative-config",
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        given = dict(given or {})
        unknown = sorted(set(given) - set(_SPECULATIVE_FLAGS.values()))
        if unknown:
            raise ValueError(
                f"--speculative-config has unknown key(s) {', '.join(unknown)}: known keys are "
                f"{', '.join(_SPECULATIVE_FLAGS.values())}."
            )
        for name, key in _SPECULATIVE_FLAGS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if key in given and given[key] != value:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} {value} disagrees with --speculative-config's {key}={given[key]!r}: "
                    "give the value once."
                )
            given[key] = value
        return SpeculativeConfig(**given) if given else None

    # -- command line -------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        group = parser.add_argument_group("engine")
        if with_model:
            group.add_argument("--model", default=None,
                               help="HF model directory or hub id (default: the bundled demo model).")
        group.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: the model's).")
        group.add_argument("--revision", default=None,
                           help="Branch, tag or commit of a hub model (default: the latest).")
        group.add_argument("--dtype", default="auto",
                           choices=["auto", "float32", "float16", "bfloat16", "half", "float", "bf16"],
                           help="'auto' follows the checkpoint (float32 on the CPU).")
        group.add_argument("--load-format", default="auto",
                           choices=["auto", "safetensors", "dummy", "bitsandbytes"],
                           help="'dummy' uses random weights at the model's real shape; "
                                "'bitsandbytes' (vLLM's name) loads a bitsandbytes checkpoint, "
                                "or quantizes at load with --quantization bitsandbytes.")
        group.add_argument("--hf-overrides", default=None,
                           help="JSON object of config.json fields to override, merged into "
                                "nested objects (e.g. '{\"rope_scaling\": {\"factor\": 4.0}}'); "
                                "a key of null removes the field.")
        group.add_argument("--generation-config", default="auto",
                           help="Where requests' sampling defaults (temperature, top_p, top_k, "
                                "min_p, repetition_penalty, max_new_tokens as max_tokens) come "
                                "from when a request does not set them: 'auto' (the model's "
                                "generation_config.json), 'none' (temperature 1, no top-p or "
                                "top-k, ...), or a folder holding a generation_config.json.")
        group.add_argument("--override-generation-config", default=None,
                           help="JSON object of sampling defaults set over --generation-config's, "
                                "in generation_config.json's names (e.g. "
                                "'{\"temperature\": 0.7, \"max_new_tokens\": 512}').")
        group.add_argument("--seed", type=int, default=0,
                           help="Seed of unseeded sampling and of dummy weights.")
        group.add_argument("--max-model-len", type=int, default=None,
                           help="Longest prompt + output, in tokens (default: the model's "
                                "max_position_embeddings).")
        group.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32],
                           help="Tokens per KV cache block.")
        group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                           help="Reuse the KV blocks of shared prompt prefixes.")
        group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                           help="Fraction of GPU memory for weights, activations and the KV cache.")
        group.add_argument("--kv-cache-memory-gb", type=float, default=2.0,
                           help="KV cache size on the CPU, in GiB.")
        group.add_argument("--num-kv-blocks", type=int, default=None,
                           help="Exact number of KV blocks (default: sized from "
                                "--kv-cache-memory-gb on the CPU, --gpu-memory-utilization on a GPU).")
        group.add_argument("--max-num-seqs", type=int, default=None,
                           help=f"Most requests running at once (default: {CUDA_MAX_NUM_SEQS} on "
                                "CUDA, 256 on the CPU).")
        group.add_argument("--max-num-batched-tokens", type=int, default=None,
                           help="Token budget of one step (default: 2048, 8192 on CUDA; "
                                "--max-model-len without chunked prefill; at least --max-num-seqs).")
        group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                           help="Split long prompts over steps so decodes keep flowing.")
        group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                           help="fcfs: first come, first served; priority: lower priority value "
                                "first, then arrival.")
        group.add_argument("--device", default=None, choices=["cpu", "cuda"],
                           help="Where the model runs (default: cuda when torch sees a GPU, else "
                                "cpu; $PAGEDLLM_DEVICE overrides the choice).")
        group.add_argument("--skip-tokenizer-init", action="store_true", default=False,
                           help="Load no tokenizer: prompts must be token ids and outputs carry "
                                "no text (automatic when the model directory has no tokenizer).")
        group.add_argument("--enforce-eager", action="store_true", default=False,
                           help="Run every step eagerly (no CUDA graphs for decode steps).")
        group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                           help="Schedule and launch each step before the previous step's sampled "
                                "ids are read, hiding host work behind the GPU (default: on with "
                                "CUDA, off on the CPU). Steps that speculate run synchronously.")
        group.add_argument("--quantization", "-q", default=None,
                           help="fp8: the decoder's projections in FP8 with per-channel weight "
                                "and per-token activation scales, computed at load from the "
                                "checkpoint's weights. bitsandbytes: 4-bit NF4 in blocks of "
                                "64, quantized at load as bitsandbytes does. "
                                "compressed-tensors, gptq, awq, auto-round, modelopt, "
                                "bitsandbytes: the method of a quantized checkpoint "
                                "(read from its config.json without the flag too; with "
                                "--load-format dummy, gptq and awq give random 4-bit "
                                "weights; gptq_marlin, gptq_bitblas and awq_marlin name the "
                                "same checkpoints, moe_wna16 any integer-weight one). "
                                "Default: the checkpoint's own.")
        group.add_argument("--kv-cache-dtype", default="auto",
                           help="auto: the KV cache in the model's dtype; fp8 (alias fp8_e4m3): "
                                "float8_e4m3fn with per-layer k/v scales (1.0 unless the "
                                "checkpoint has them), twice the tokens of a bf16 cache (GPUs of "
                                "compute capability 8.9+, or the CPU).")
        parallel = parser.add_argument_group("parallelism")
        parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                              help="Split every layer over this many GPUs (CPU processes on "
                                   "the CPU): attention heads, MLP columns and the vocabulary, "
                                   "with an all-reduce after attention and after the MLP.")
        parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                              help="Split the decoder layers into this many stages (GPUs, or "
                                   "nodes with Ray), each working on another step; combines "
                                   "with --tensor-parallel-size (tp x pp ranks).")
        parallel.add_argument("--distributed-executor-backend", default=None,
                              choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                              help="mp: one worker process per GPU on this host (the default "
                                   "with --tensor-parallel-size > 1); ray: Ray actors placed on "
                                   "the nodes of a Ray cluster.")
        parallel.add_argument("--ray-address", default=None,
                              help="The Ray cluster's address (default: $RAY_ADDRESS, else the "
                                   "cluster running on this machine, else a new local one).")
        group.add_argument("--swap-space", type=float, default=0.0,
                           help="GiB of host memory (per GPU) that preempted requests' KV is "
                                "swapped out to and copied back from, instead of being "
                                "computed again; pinned at start-up. 0: recompute.")
        group.add_argument("--trust-remote-code", action="store_true", default=False,
                           help="Accepted as vLLM takes it: pagedllm runs no code from a model "
                                "repository (every architecture it serves is its own), so it "
                                "changes nothing.")
        # Accepted so the refusal message is clear rather than argparse's "unrecognized".
        group.add_argument("--enable-lora", action="store_true", default=False, help=argparse.SUPPRESS)
        group.add_argument("--cpu-offload-gb", type=float, default=0, help=argparse.SUPPRESS)
        group.add_argument("--download-dir", default=None, help=argparse.SUPPRESS)

        spec = parser.add_argument_group("speculative decoding")
        spec.add_argument("--speculative-model", default=None,
                          help="A draft model (directory, hub id or bundled name, e.g. "
                               "pagedllm-demo-draft) with the target's vocabulary: it proposes "
                               "--num-speculative-tokens tokens per step, which the target "
                               "verifies in one forward pass (default: no speculation).")
        spec.add_argument("--num-speculative-tokens", type=int, default=None,
                          help="K: tokens proposed per request per step (1 to 16).")
        spec.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                          help="ngram: propose the tokens that followed an earlier occurrence of "
                               "the request's last tokens in its own prompt and output (no "
                               "model); draft_model: --speculative-model (implied by it).")
        spec.add_argument("--ngram-prompt-lookup-min", type=int, default=None,
                          help="ngram: the shortest suffix matched (default: 1).")
        spec.add_argument("--ngram-prompt-lookup-max", type=int, default=None,
                          help="ngram: the longest suffix matched, tried first (default: 4).")
        spec.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                          help="N: a step with more than N running requests speculates for "
                               "none of them (default: always speculate).")
        spec.add_argument("--speculative-config", default=None,
                          help='vLLM\'s form, as JSON: {"method": "ngram" | "draft_model", '
                               '"model": ..., "num_speculative_tokens": K, "prompt_lookup_min": '
                               '..., "prompt_lookup_max": ..., "disable_by_batch_size": N}.')

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)} | set(_NOT_YET_SUPPORTED)
        return cls.from_kwargs(**{k: v for k, v in vars(args).items() if k in names})
