"""TLS of the embedding RPC: PEM files read and checked, and the gRPC credentials both sides build from them.

A file that is missing, unreadable or holds no PEM is a ValueError naming the setting it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from disagg.config import EmbeddingServiceConfig


@dataclass(frozen=True)
class ServerTLS:
    """PEM material of a TLS server; with ``client_ca``, clients must present a certificate it signed (mTLS)."""

    certificate_chain: bytes
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def read_pem(path: str | Path, setting: str) -> bytes:
    """The PEM file at ``path``; ValueError naming ``setting`` when it is missing, unreadable or holds no PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{setting}: cannot read {path}: {error.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{setting}: {path} holds no PEM block")
    return data


def server_tls(config: EmbeddingServiceConfig) -> ServerTLS | None:
    """The shard servers' TLS material read from ``config``'s files now, or None for plaintext."""
    if not config.tls:
        return None
    return ServerTLS(_read(config, "tls_cert_file"), _read(config, "tls_key_file"),
                     client_ca=_read(config, "tls_ca_file") if config.tls_client_auth else None)


def channel_credentials(config: EmbeddingServiceConfig) -> grpc.ChannelCredentials | None:
    """What dense replicas connect to shard servers with, read from ``config``'s files now (None: plaintext)."""
    if not config.tls:
        return None
    if not config.tls_client_auth:
        return grpc.ssl_channel_credentials(root_certificates=_read(config, "tls_ca_file"))
    return grpc.ssl_channel_credentials(_read(config, "tls_ca_file"), _read(config, "tls_key_file"),
                                        _read(config, "tls_cert_file"))


def _read(config: EmbeddingServiceConfig, setting: str) -> bytes:
    return read_pem(getattr(config, setting), f"embedding.{setting}")
