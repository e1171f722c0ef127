"""Who may fetch an adapter from the control plane: a function pod, for its own function's adapter only.

The controller serves each stored adapter by digest on an internal route (`GET /internal/adapters/<digest>/<file>`,
gateway/adapter_route.py) so that a function pod on any node gets its adapter without a volume shared between nodes
(function_runtime/adapter_fetch.py). The route takes no API key, a tenant's or the admin's: only a token the
controller minted when it made the pod, an HMAC of (function, digest) under a key derived from the admin key. It opens
that one adapter and nothing else: another function's digest, or another function's name, is a 403. The key is
derived from the admin key (not kept anywhere else) so that a restarted controller still honours the tokens of pods
its predecessor made; without an admin key at hand it is random for the process.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from lorafaas.errors import Forbidden

KEY_CONTEXT = b"lorafaas adapter access v1"


class AdapterAccess:
    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("an adapter access key has at least 32 bytes")
        self._key = key

    @classmethod
    def from_admin_key(cls, admin_key: str | None) -> AdapterAccess:
        if not admin_key:
            return cls(secrets.token_bytes(32))
        return cls(hmac.new(admin_key.encode(), KEY_CONTEXT, hashlib.sha256).digest())

    def token(self, function: str, digest: str) -> str:
        """The credential of `function`'s pods for adapter `digest`."""
        return hmac.new(self._key, f"{function}\n{digest}".encode(), hashlib.sha256).hexdigest()

    def check(self, function: str | None, digest: str, authorization: str | None) -> None:
        """Forbidden unless `authorization` is `Bearer <token(function, digest)>`."""
        scheme, _, presented = (authorization or "").partition(" ")
        if not function or scheme.lower() != "bearer" or not hmac.compare_digest(
                presented.strip().encode(), self.token(function, digest).encode()):
            raise Forbidden(f"adapter {digest[:12]} is served only to the pods of a function that uses it, with the "
                            "credential the controller gave them; API keys do not open it")
