"""On a GPU: decode steps replay CUDA graphs, and greedy tokens equal the eager engine's."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.cuda_graphs import capture_sizes
from tests.utils import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_cuda_graph_decode_gives_the_eager_greedy_tokens(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    prompts = [{"prompt_token_ids": [(5 * i + 11 * j) % 240 + 8 for j in range(4 + 9 * i)]}
               for i in range(9)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 4 * i, ignore_eos=True)
              for i in range(9)]
    kwargs = dict(dtype="float32", max_model_len=160, max_num_seqs=16, block_size=16,
                  device="cuda")
    graphed = LLM(str(path), **kwargs)
    runner = graphed.llm_engine.engine_core.model_runner
    assert runner.graph_runner is not None
    replays = []
    original_run = runner.graph_runner.run
    runner.graph_runner.run = lambda inputs: replays.append(inputs.num_tokens) or original_run(inputs)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]

    eager = LLM(str(path), enforce_eager=True, **kwargs)
    assert eager.llm_engine.engine_core.model_runner.graph_runner is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert set(replays) >= {9, 5, 1}  # padded to 16, 8 and replayed exactly at 1
    assert sorted(runner.graph_runner._graphs) == capture_sizes(16)
