"""``pagedllm serve`` over HTTPS (``--ssl-keyfile``, ``--ssl-certfile``) and with client
certificates (``--ssl-ca-certs``, ``--ssl-cert-reqs``): the official client reaches it
through a CA it trusts; clients without a certificate, without the CA, or speaking plain
HTTP are turned away; files that do not make a TLS server are refused before the model
loads."""

from __future__ import annotations

import argparse
import ssl

import httpx
import openai
import pytest
import trustme

from pagedllm.entrypoints.openai.cli_args import add_serve_args, validate_serve_args
from tests.server.conftest import MODEL_NAME, started_server


@pytest.fixture(scope="module")
def authority():
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_files(authority, tmp_path_factory):
    """The server's key and certificate chain for 127.0.0.1, and the CA's certificate."""
    root = tmp_path_factory.mktemp("tls")
    issued = authority.issue_cert("127.0.0.1", "localhost")
    files = {"key": root / "key.pem", "cert": root / "cert.pem", "ca": root / "ca.pem"}
    issued.private_key_pem.write_to_path(str(files["key"]))
    for i, pem in enumerate(issued.cert_chain_pems):
        pem.write_to_path(str(files["cert"]), append=i > 0)
    authority.cert_pem.write_to_path(str(files["ca"]))
    return files


def _client_context(authority: trustme.CA, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context()
    authority.configure_trust(context)
    if with_certificate:
        authority.issue_cert("client.example").configure_cert(context)
    return context


def test_the_official_client_over_https_with_a_client_certificate(
        server_model_dir, tmp_path_factory, authority, tls_files):
    trusted = _client_context(authority, with_certificate=True)
    with started_server(server_model_dir, tmp_path_factory, "tls", "--ssl-keyfile",
                        str(tls_files["key"]), "--ssl-certfile", str(tls_files["cert"]),
                        "--ssl-ca-certs", str(tls_files["ca"]), "--ssl-cert-reqs", "2",
                        tls=trusted) as remote:
        with openai.OpenAI(base_url=remote.api_url, api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=trusted)) as client:
            completion = client.completions.create(model=MODEL_NAME, prompt="hello",
                                                   max_tokens=4, temperature=0.0)
            assert completion.usage.completion_tokens >= 1
            streamed = client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                max_tokens=3, stream=True)
            assert [chunk for chunk in streamed if chunk.choices]
        # No client certificate, with --ssl-cert-reqs 2: the handshake is refused.
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{remote.base_url}/health",
                      verify=_client_context(authority, with_certificate=False))
        # A client that does not trust the CA refuses the server's certificate.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{remote.base_url}/health")
        # Plain HTTP to the HTTPS port gets no HTTP answer.
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{remote.port}/health")
        assert f"at https://127.0.0.1:{remote.port}/v1" in remote.log()


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(flags))


def test_files_that_do_not_make_a_tls_server_are_refused_before_the_model_loads(
        tls_files, tmp_path):
    key, cert, ca = (str(tls_files[name]) for name in ("key", "cert", "ca"))
    validate_serve_args(_parse("--ssl-keyfile", key, "--ssl-certfile", cert))
    with pytest.raises(ValueError, match="do not load as a PEM key"):
        validate_serve_args(_parse("--ssl-keyfile", cert, "--ssl-certfile", cert))
    with pytest.raises(ValueError, match="checks client certificates against --ssl-ca-certs"):
        validate_serve_args(_parse("--ssl-keyfile", key, "--ssl-certfile", cert,
                                   "--ssl-cert-reqs", "2"))
    with pytest.raises(ValueError, match="--ssl-cert-reqs must be 0"):
        validate_serve_args(_parse("--ssl-keyfile", key, "--ssl-certfile", cert,
                                   "--ssl-ca-certs", ca, "--ssl-cert-reqs", "3"))
    from cryptography.hazmat.primitives import serialization  # trustme's own dependency

    encrypted = tmp_path / "encrypted.pem"
    private = serialization.load_pem_private_key(tls_files["key"].read_bytes(), None)
    encrypted.write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(ValueError, match="encrypted: give a key file without a passphrase"):
        validate_serve_args(_parse("--ssl-keyfile", str(encrypted), "--ssl-certfile", cert))
