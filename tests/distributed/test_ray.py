"""Tensor parallelism on Ray: a local Ray cluster of two CPUs (started here, as
``ray start --head`` would) places the two ranks as actors, and greedy tokens equal HF
transformers'."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts
from tests.distributed.test_tensor_parallel import _checkpoint

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_ray_actors_run_tp2_with_hf_greedy_tokens(ray_cluster, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(3, 4, 16, seed=11)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray",
              max_model_len=128)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_engines_switches_reach_every_rank(ray_cluster, monkeypatch) -> None:
    """A PAGEDLLM_* variable set in the engine's process after the cluster started (as on
    another node, whose processes never saw it) is what a rank actor reads."""
    from pagedllm.distributed.ray_executor import RayWorker, rank_actor_options

    monkeypatch.setenv("PAGEDLLM_DECODE_PROGRAMS_PER_SM", "3")
    actor = ray.remote(RayWorker).options(**rank_actor_options("CPU")).remote()
    try:
        assert ray.get(actor.getenv.remote("PAGEDLLM_DECODE_PROGRAMS_PER_SM")) == "3"
    finally:
        ray.kill(actor)


def test_a_cluster_too_small_is_refused_with_what_to_do(ray_cluster, tmp_path) -> None:
    path = _checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="need 4 CPUs in the Ray cluster, which has 2"):
        LLM(str(path), tensor_parallel_size=4, distributed_executor_backend="ray")
