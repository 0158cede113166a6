"""``pagedllm doctor``: every check against faked conditions (a GPU that is not there, a
missing model, a port in use, a tiny /dev/shm, a template without tool markers...)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from types import SimpleNamespace

import pytest

from pagedllm.config import BUNDLED_MODELS_DIR
from pagedllm.entrypoints import doctor
from pagedllm.entrypoints.cli import build_parser, main

GIB = 1 << 30


def _args(*argv: str):
    return build_parser().parse_args(["doctor", *argv])


def _by_name(checks):
    return {check.name: check for check in checks}


def _fake_cuda(capability=(9, 0), total_gib=80.0, count=1):
    return SimpleNamespace(
        is_available=lambda: True, device_count=lambda: count,
        get_device_capability=lambda index: capability,
        get_device_name=lambda index: "Fake GPU",
        mem_get_info=lambda index: (int(total_gib * GIB), int(total_gib * GIB)),
    )


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


NO_CUDA = SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)


@pytest.fixture(autouse=True)
def _no_device_env(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_DEVICE", raising=False)


def test_the_demo_model_on_the_cpu_passes_with_one_warning_for_the_missing_gpu():
    checks = doctor.run_checks(_args("--host", "127.0.0.1", "--port", _free_port()),
                               cuda=NO_CUDA)
    statuses = {c.name: c.status for c in checks}
    assert statuses == {"flags": "PASS", "gpu": "WARN", "model": "PASS", "tokenizer": "PASS",
                        "chat template": "PASS", "shm": statuses["shm"], "nccl": "SKIP",
                        "port": "PASS", "swap space": "SKIP", "kv cache": "PASS"}
    assert doctor.exit_code(checks) == 0
    assert doctor.exit_code(checks, strict=True) == 1


def test_no_gpu_is_a_failure_when_cuda_is_asked_for():
    gpu = doctor.check_gpu(_args("--device", "cuda"), NO_CUDA)
    assert gpu.status == "FAIL" and "--device cpu" in gpu.fix


def test_fp8_on_the_cpu_warns_of_the_float32_reference_path():
    gpu = doctor.check_gpu(_args("--quantization", "fp8"), NO_CUDA)
    assert gpu.status == "WARN" and "float32 reference" in gpu.detail


@pytest.mark.parametrize("capability, status", [((9, 0), "PASS"), ((8, 9), "PASS"),
                                                ((8, 0), "WARN")])
def test_fp8_needs_compute_capability_8_9(capability, status):
    gpu = doctor.check_gpu(_args("--quantization", "fp8"), _fake_cuda(capability))
    assert gpu.status == status
    assert f"compute capability {capability[0]}.{capability[1]}" in gpu.detail


@pytest.mark.parametrize("capability, status", [((9, 0), "PASS"), ((8, 9), "PASS"),
                                                ((8, 6), "FAIL")])
def test_an_fp8_kv_cache_needs_compute_capability_8_9(capability, status):
    gpu = doctor.check_gpu(_args("--kv-cache-dtype", "fp8_e4m3"), _fake_cuda(capability))
    assert gpu.status == status
    if status == "FAIL":
        assert "--kv-cache-dtype fp8 needs 8.9+" in gpu.detail and "--kv-cache-dtype" in gpu.fix


def test_an_unsupported_kv_cache_dtype_fails_the_flags_check():
    flags = doctor.check_flags(_args("--kv-cache-dtype", "int8"))
    assert flags.status == "FAIL" and "--kv-cache-dtype int8" in flags.detail


def test_bfloat16_below_compute_capability_8_warns():
    assert doctor.check_gpu(_args("--dtype", "bfloat16"), _fake_cuda((7, 5))).status == "WARN"
    assert doctor.check_gpu(_args("--dtype", "float16"), _fake_cuda((7, 5))).status == "PASS"


def test_a_refused_flag_fails_the_flags_check():
    flags = doctor.check_flags(_args("--enable-lora"))
    assert flags.status == "FAIL" and "--enable-lora" in flags.detail


def test_an_uncached_hub_model_warns_online_and_fails_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    check, path = doctor.check_model(_args("some-org/not-cached-model"))
    assert (check.status, path) == ("WARN", None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check, _ = doctor.check_model(_args("some-org/not-cached-model"))
    assert check.status == "FAIL" and "HF_HUB_OFFLINE" in check.detail
    assert "huggingface-cli download some-org/not-cached-model" in check.fix


def _model_dir(tmp_path, template: str | None = None, weights: bool = True):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(BUNDLED_MODELS_DIR / "pagedllm-demo" / "config.json", model)
    if weights:
        (model / "model.safetensors").write_bytes(b"\0" * 8)
    config = {"chat_template": template} if template is not None else {}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_a_model_directory_without_weights_or_with_missing_shards_fails(tmp_path):
    model = _model_dir(tmp_path, weights=False)
    check, _ = doctor.check_model(_args(str(model)))
    assert check.status == "FAIL" and "no *.safetensors" in check.detail
    assert doctor.check_model(_args(str(model), "--load-format", "dummy"))[0].status == "PASS"
    (model / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 8)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    check, _ = doctor.check_model(_args(str(model)))
    assert check.status == "FAIL" and "1 of the 2 weight shards" in check.detail


def test_a_missing_model_directory_path_fails(tmp_path):
    (tmp_path / "empty").mkdir()
    check, path = doctor.check_model(_args(str(tmp_path / "empty")))
    assert (check.status, path) == ("FAIL", None) and "config.json" in check.detail


def test_no_chat_template_warns_that_chat_answers_400(tmp_path):
    model = _model_dir(tmp_path)
    [check] = doctor.check_chat_template(_args(str(model)), model)
    assert check.status == "WARN" and "400" in check.detail


HERMES_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}Call with "
                   "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}")
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}"


@pytest.mark.parametrize("template, parser, status", [
    (HERMES_TEMPLATE, "hermes", "PASS"),
    (PLAIN_TEMPLATE, "hermes", "WARN"),
    (HERMES_TEMPLATE, "mistral", "WARN"),
    ("{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}{{ tools }}", "mistral", "PASS"),
    ("{{ tools }} [func_name1(params_name1=params_value1)]", "pythonic", "PASS"),
    ("{{ tools }} {\"name\": function name, \"parameters\": {...}}", "llama3_json", "PASS"),
])
def test_the_tool_call_parser_must_match_the_template(tmp_path, template, parser, status):
    model = _model_dir(tmp_path, template)
    args = _args(str(model), "--enable-auto-tool-choice", "--tool-call-parser", parser)
    template_check, parser_check = doctor.check_chat_template(args, model)
    assert template_check.status == "PASS"
    assert parser_check.status == status


def test_a_template_that_ignores_tools_warns(tmp_path):
    model = _model_dir(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    args = _args(str(model), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    _, parser_check = doctor.check_chat_template(args, model)
    assert parser_check.status == "WARN" and "never reads `tools`" in parser_check.detail


def test_a_tiny_dev_shm_warns(monkeypatch):
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_blocks=16384, f_frsize=4096))
    check = doctor.check_shm(_args())
    assert check.status == "WARN" and "0.06 GiB" in check.detail and "--ipc=host" in check.fix
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_blocks=2 << 20, f_frsize=4096))
    assert doctor.check_shm(_args()).status == "PASS"


def test_nccl_checks_the_gpus_tensor_parallelism_needs():
    assert doctor.check_nccl(_args(), _fake_cuda()).status == "SKIP"
    tp2 = _args("--tensor-parallel-size", "2")
    short = doctor.check_nccl(tp2, _fake_cuda(count=1))
    assert short.status == "FAIL" and "needs 2 GPUs and 1" in short.detail
    no_p2p = _fake_cuda(count=2)
    no_p2p.can_device_access_peer = lambda i, j: False
    warned = doctor.check_nccl(tp2, no_p2p)
    assert warned.status == "WARN" and "NCCL_P2P_DISABLE=1" in warned.fix
    both = _fake_cuda(count=2)
    both.can_device_access_peer = lambda i, j: True
    assert doctor.check_nccl(tp2, both).status == "PASS"


def test_tensor_parallelism_on_gpus_fails_a_small_dev_shm():
    from pagedllm.distributed import checks

    message = checks.shm_problem(64 << 20, 2)
    assert "64 MiB" in message and "--ipc=host" in message
    assert checks.shm_problem(16 << 30, 2) is None


def test_a_port_in_use_fails():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        check = doctor.check_port(_args("--host", "127.0.0.1", "--port", str(port)))
    assert check.status == "FAIL" and f"127.0.0.1:{port}" in check.detail
    assert doctor.check_port(_args("--host", "127.0.0.1", "--port", str(port))).status == "PASS"


def test_kv_cache_on_a_gpu_from_weights_and_utilization():
    """llama-3.1-8b in bf16 on an 80 GiB GPU: 0.9 x 80 GiB = 77,309,411,328 bytes less
    8,030,261,248 x 2 bytes of weights = 61,248,888,832 bytes; 2 MiB blocks -> 29,205
    blocks, 467,280 tokens; at 131,072 tokens (8,192 blocks) 3 requests fit."""
    args = _args("llama-3.1-8b", "--load-format", "dummy")
    check = doctor.check_kv_cache(args, doctor.check_model(args)[1], _fake_cuda(total_gib=80))
    assert check.status == "WARN"
    assert "467280 tokens in 29205 blocks" in check.detail
    assert "at --max-model-len 131072, 3 requests fit" in check.detail
    assert "largest --max-model-len that fits is 131072" in check.detail
    assert "lower --max-num-seqs to 3 or --max-model-len to 1824" in check.fix  # 29205 // 256 x 16


def test_an_fp8_kv_cache_on_a_gpu_holds_twice_the_tokens():
    """As above with one byte an element: 1 MiB blocks -> 58,411 blocks, 934,576 tokens;
    at 131,072 tokens, 7 requests fit."""
    args = _args("llama-3.1-8b", "--load-format", "dummy", "--kv-cache-dtype", "fp8")
    check = doctor.check_kv_cache(args, doctor.check_model(args)[1], _fake_cuda(total_gib=80))
    assert "934576 tokens in 58411 blocks of 1.00 MiB (fp8 KV cache)" in check.detail
    assert "at --max-model-len 131072, 7 requests fit" in check.detail


def test_4bit_weights_on_a_gpu_leave_the_kv_cache_more_room():
    """llama-3.1-8b with --quantization gptq (4-bit, groups of 128) on an 80 GiB GPU: the
    projections 114,163,712 bytes a layer as stored, + two bf16 norms 16,384, x 32 layers +
    bf16 embedding, LM head and final norm 2,101,354,496 = 5,755,117,568 bytes of weights;
    77,309,411,328 less that = 71,554,293,760 bytes -> 34,119 blocks of 2 MiB, 545,904
    tokens; at 131,072 tokens, 4 requests fit."""
    args = _args("llama-3.1-8b", "--load-format", "dummy", "--quantization", "gptq")
    check = doctor.check_kv_cache(args, doctor.check_model(args)[1], _fake_cuda(total_gib=80))
    assert "less 5.36 GiB of bfloat16 + int4 weights" in check.detail
    assert "545904 tokens in 34119 blocks" in check.detail
    assert "at --max-model-len 131072, 4 requests fit" in check.detail


def test_kv_cache_on_the_cpu_from_kv_cache_memory_gb():
    """qwen3-0.6b in float32 on the CPU: 1 GiB / (2 x 28 x 16 x 8 x 128 x 4 bytes) = 292
    blocks = 4,672 tokens."""
    args = _args("qwen3-0.6b", "--load-format", "dummy", "--kv-cache-memory-gb", "1",
                 "--max-model-len", "1024", "--max-num-seqs", "4")
    check = doctor.check_kv_cache(args, doctor.check_model(args)[1], NO_CUDA)
    assert check.status == "PASS" and "4672 tokens in 292 blocks" in check.detail
    assert "4 requests fit" in check.detail
    args = _args("qwen3-0.6b", "--load-format", "dummy", "--kv-cache-memory-gb", "1",
                 "--max-model-len", "8192")
    check = doctor.check_kv_cache(args, doctor.check_model(args)[1], NO_CUDA)
    assert check.status == "FAIL" and "lower --max-model-len to 4672" in check.fix


def test_a_draft_models_kv_shares_the_blocks_and_the_count_says_so():
    """The demo model (6 layers x 2 KV heads x 64, float32: 96 KiB a 16-token block) with
    its draft (3 layers, the same heads: 48 KiB more) in 1 GiB: 7,281 blocks of 144 KiB
    instead of 10,922 of 96 KiB."""
    plain = doctor.check_kv_cache(_args("--kv-cache-memory-gb", "1"),
                                  doctor.check_model(_args())[1], NO_CUDA)
    args = _args("--kv-cache-memory-gb", "1", "--speculative-model", "pagedllm-demo-draft",
                 "--num-speculative-tokens", "3")
    check = doctor.check_kv_cache(args, doctor.check_model(args)[1], NO_CUDA)
    assert "174752 tokens in 10922 blocks" in plain.detail
    assert "116496 tokens in 7281 blocks of 0.14 MiB" in check.detail
    assert "(target and draft model)" in check.detail


def test_the_command_exits_1_on_a_failure_and_prints_the_fix(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["doctor", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "FAIL  port" in out and "fix: pass another --port" in out
    assert main(["doctor", "--device", "cpu", "--host", "127.0.0.1", "--port", _free_port()]) == 0


def test_swap_space_is_checked_against_the_host_memory_of_every_rank():
    assert doctor.check_swap_space(_args(), available=64 << 30).status == "SKIP"
    two = _args("--swap-space", "4", "--tensor-parallel-size", "2")
    failed = doctor.check_swap_space(two, available=6 << 30)
    assert failed.status == "FAIL" and failed.detail == (
        "--swap-space 4 x 2 ranks = 8.0 GiB is more than the 6.0 GiB of host memory "
        "available: lower it.")
    assert doctor.check_swap_space(two, available=10 << 30).status == "WARN"
    assert doctor.check_swap_space(two, available=64 << 30).status == "PASS"
    assert doctor.check_swap_space(two, available=None).status == "WARN"
