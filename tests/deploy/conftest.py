"""The tiny served model of tests/server, for the tests that run a live server."""

from tests.server.conftest import server_model_dir  # noqa: F401
