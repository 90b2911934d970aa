"""Control-plane security: TLS credentials and bearer-token authentication.

TLS: a server certificate and key, and optionally a client CA, in which case
clients must present a certificate it signed (mutual TLS). A server refuses
to start on a certificate that has expired or is not yet valid (every
certificate in the --tls-cert file is checked), rather than serve one that
every client rejects. Token: when one is
configured every RPC except the gRPC health service must carry
``authorization: Bearer <token>``; data transports then admit only sessions
opened by such authenticated calls (they check the per-session secret).
"""

from __future__ import annotations

import datetime
import hmac

import grpc

from tableserver.errors import ConfigError

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


#: the largest key, certificate, CA or token file read (a PEM chain is a few KiB)
MAX_FILE_BYTES = 1 << 20


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path} ({e.strerror}): fix the path") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_FILE_BYTES >> 20} MiB: pass the right file")
    return data


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    if bool(cert) != bool(key):
        raise ConfigError("--tls-cert and --tls-key go together: pass both, or neither")
    if client_ca and not cert:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS runs over TLS)")
    ca = _read(client_ca, "TLS client CA") if client_ca else None
    chain = _read(cert, "TLS certificate")
    check_validity(cert, chain)
    return grpc.ssl_server_credentials(
        [(_read(key, "TLS key"), chain)], root_certificates=ca, require_client_auth=ca is not None
    )


def check_validity(path: str, pem: bytes, now: datetime.datetime | None = None) -> None:
    """ConfigError unless every certificate in ``pem`` (the file ``path``) is valid at ``now``."""
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as e:
        raise ConfigError(f"TLS certificate {path} holds no PEM certificate ({e}): fix --tls-cert") from None
    now = now or datetime.datetime.now(datetime.UTC)
    for c in certs:
        subject = c.subject.rfc4514_string() or "(no subject)"
        after, before = c.not_valid_after_utc, c.not_valid_before_utc
        if now > after:
            raise ConfigError(
                f"TLS certificate {path} ({subject}) expired: notAfter {after:%Y-%m-%d %H:%M:%S} UTC; "
                "renew it and pass the new one to --tls-cert"
            )
        if now < before:
            raise ConfigError(
                f"TLS certificate {path} ({subject}) is not valid yet: notBefore "
                f"{before:%Y-%m-%d %H:%M:%S} UTC; check this host's clock or reissue it"
            )


def load_token(token: str | None, token_file: str | None) -> str | None:
    if token and token_file:
        raise ConfigError("pass --auth-token or --auth-token-file, not both")
    if token_file:
        token = _read(token_file, "auth token file").decode().strip()
        if not token:
            raise ConfigError(f"auth token file {token_file} is empty: write the token into it")
    return token or None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the configured bearer token (UNAUTHENTICATED)."""

    def __init__(self, token: str, on_reject=None):
        self._expected = f"Bearer {token}".encode()
        self._on_reject = on_reject

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, self._expected):
            return handler
        if self._on_reject is not None:
            self._on_reject(details.method)
        message = (
            "missing bearer token: pass token= to TableClient (or TABLESERVER_AUTH_TOKEN)"
            if not got
            else "wrong bearer token: check the client's token against the server's --auth-token"
        )
        return _deny(handler, message)


def _deny(handler, message: str):
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)
