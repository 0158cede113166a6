"""The FastAPI app of ``build_app`` around a stand-in engine, for tests of what the app does
before and around the engine (routes, auth, limits, health) without a model or a process."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels


class StubEngine:
    """Just enough of ``AsyncEngine`` for ``build_app``; ``die()`` marks it dead."""

    def __init__(self) -> None:
        self.tokenizer = None
        self.max_model_len = 64
        self.config = SimpleNamespace(scheduler_config=SimpleNamespace(policy="fcfs"),
                                      model_config=SimpleNamespace(sampling_defaults={}))
        self.dead_error: EngineDeadError | None = None

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None

    def die(self) -> None:
        self.dead_error = EngineDeadError("The engine core process exited unexpectedly (code -9).")

    def add_request(self, *args, **kwargs):
        if self.dead_error is not None:
            raise self.dead_error
        raise RuntimeError("a stand-in engine runs nothing")


def stub_app(**kwargs):
    """``build_app`` on a ``StubEngine`` (returned too); ``kwargs`` go to ``build_app``."""
    engine = StubEngine()
    models = OpenAIServingModels(["stub"], "stub", engine.max_model_len)
    return build_app(engine, models, **kwargs), engine
