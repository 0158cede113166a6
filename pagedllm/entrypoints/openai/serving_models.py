"""The models this server serves: ``GET /v1/models`` and the ``model`` field of requests."""

from __future__ import annotations

import time

from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList, OpenAIError


class OpenAIServingModels:
    """Every served name is one model card; a request may name any of them (or none).

    ``root`` is where the weights came from (a directory or hub id), so operators can tell
    which checkpoint an alias points to.
    """

    def __init__(self, served_model_names: list[str], root: str, max_model_len: int) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model.")
        self.served_model_names = list(served_model_names)
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())

    @property
    def default_name(self) -> str:
        return self.served_model_names[0]

    def list_models(self) -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, created=self.created, root=self.root, max_model_len=self.max_model_len)
            for name in self.served_model_names
        ])

    def resolve(self, name: str | None) -> str:
        """The name to answer with; raises a 404 ``OpenAIError`` for a model not served here."""
        if name is None or name == "":
            return self.default_name
        if name in self.served_model_names:
            return name
        raise OpenAIError(
            f"The model {name!r} does not exist on this server; it serves "
            f"{', '.join(repr(n) for n in self.served_model_names)} (see GET /v1/models).",
            status=404, param="model", code="model_not_found",
        )
