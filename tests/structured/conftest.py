from tests.engine.conftest import hf_model, tiny_model_dir  # noqa: F401 - shared fixtures
