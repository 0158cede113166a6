"""The front end's output processing: what each output kind hands out, with and without text."""

from __future__ import annotations

from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def _step(processor: OutputProcessor, tokens: dict[str, int], finished: bool = False):
    outputs, to_abort = processor.process_outputs([
        EngineCoreOutput(request_id=rid, new_token_ids=[t],
                         finish_reason="length" if finished else None)
        for rid, t in tokens.items()])
    assert to_abort == []
    return outputs


def test_a_final_request_gives_one_output_once_every_sequence_has_ended(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, PROMPT, SamplingParams(n=2, max_tokens=3), output_kind="final")
    assert _step(processor, {"0_r": 40, "1_r": 41}) == []
    assert _step(processor, {"0_r": 42}, finished=True) == []  # the first sequence ends
    [output] = _step(processor, {"1_r": 43}, finished=True)
    assert output.finished and not processor.has_unfinished_requests()
    assert [c.token_ids for c in output.outputs] == [[40, 42], [41, 43]]
    assert [c.text for c in output.outputs] == [tokenizer.decode([40, 42]),
                                                tokenizer.decode([41, 43])]


def test_streamed_token_ids_without_text_when_detokenize_is_off(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, PROMPT, SamplingParams(max_tokens=3, detokenize=False),
                          output_kind="delta")
    deltas = [_step(processor, {"r": 40}), _step(processor, {"r": 41}),
              _step(processor, {"r": 42}, finished=True)]
    assert [[c.token_ids for o in step for c in o.outputs] for step in deltas] == [
        [[40]], [[41]], [[42]]]
    assert all(c.text == "" for step in deltas for o in step for c in o.outputs)
    assert deltas[-1][0].finished
