"""An API process that attaches to a running engine core (``--api-server-count N``) can send
a request the moment it has attached, and gets that request's outputs."""

from __future__ import annotations

import asyncio

from pagedllm.core.request import Request
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.sampling_params import SamplingParams


async def _generate(client: EngineCoreClient, request: Request) -> list[int]:
    client.add_requests([request])
    tokens: list[int] = []
    while True:
        result = await asyncio.wait_for(client.get_output(), 60)
        for output in result.outputs:
            assert output.request_id == request.request_id
            tokens += output.new_token_ids
            if output.finish_reason is not None:
                return tokens


def test_a_freshly_attached_process_sends_at_once_and_gets_its_tokens(tiny_model_dir):
    config = EngineArgs(model=str(tiny_model_dir), device="cpu",
                        num_kv_blocks=64).create_engine_config()

    async def run() -> tuple[list[int], list[int]]:
        first = await EngineCoreClient.start(config, num_api_servers=2)
        attached = None
        try:
            params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
            attached = EngineCoreClient.attach(first.handle(1))
            # No pause: before the core's end of the link is up, a send must still land.
            from_attached = await _generate(attached, Request("b-0", [9, 10, 11], params,
                                                              max_model_len=256))
            from_first = await _generate(first, Request("a-0", [9, 10, 11], params,
                                                        max_model_len=256))
            return from_attached, from_first
        finally:
            if attached is not None:
                await attached.shutdown()
            await first.shutdown()

    from_attached, from_first = asyncio.run(run())
    assert len(from_attached) == 6
    assert from_attached == from_first
