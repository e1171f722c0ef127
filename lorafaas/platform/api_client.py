"""The CLI's client of a lorafaas gateway (httpx); error bodies come back as the LorafaasError that produced them."""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import msgspec

from lorafaas.config import LorafaasConfig
from lorafaas.errors import PlatformUnavailable, Unauthorized
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.platform.auth import KeyInfo, read_admin_key
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.sse import events
from lorafaas.wire import error_class

DEFAULT_URL = "http://127.0.0.1:8080"
URL_FILE = "gateway.url"  # in the home: where the local platform (`lorafaas up`) listens, for the CLI to find it


def resolve_url(config: LorafaasConfig, given: str | None) -> str:
    """`given` (--url, else $LORAFAAS_URL), else the URL a local platform recorded in the home, else DEFAULT_URL."""
    if given:
        return given
    try:
        recorded = (config.home / URL_FILE).read_text().strip()
    except FileNotFoundError:
        recorded = ""
    return recorded or DEFAULT_URL


def record_url(home: Path, url: str) -> None:
    """Written by `lorafaas up` once it serves (atomically: a CLI reading it never sees half a URL)."""
    partial = home / f".{URL_FILE}.{os.getpid()}"
    partial.write_text(url + "\n")
    partial.replace(home / URL_FILE)


def forget_url(home: Path, url: str) -> None:
    """Removed by `lorafaas up` when it stops, unless another platform on this home has recorded its own since."""
    path = home / URL_FILE
    try:
        if path.read_text().strip() == url:
            path.unlink()
    except FileNotFoundError:
        pass


def resolve_key(config: LorafaasConfig) -> str:
    """$LORAFAAS_API_KEY, else the local platform's admin key in $LORAFAAS_HOME/admin.key."""
    key = os.environ.get("LORAFAAS_API_KEY")
    if key:
        return key
    if (config.home / "admin.key").is_file():
        return read_admin_key(config.home)
    raise Unauthorized(
        f"no API key: set LORAFAAS_API_KEY, or start a local platform with `lorafaas up` (it keeps its admin key in "
        f"{config.home / 'admin.key'})"
    )


class FunctionList(msgspec.Struct):
    """GET /v1/functions' body, as the client decodes it (the gateway's `responses.FunctionList`)."""

    functions: list[FunctionSpec]


class KeyList(msgspec.Struct):
    keys: list[KeyInfo]


class ApiClient:
    def __init__(self, url: str, key: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        # Plain http needs no certificates: loading the CA bundle would cost every command 100+ ms.
        tls = self.url.startswith("https://")
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"},
                                  timeout=httpx.Timeout(timeout_s, connect=5.0), verify=tls)

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._http.close()

    # -- functions -------------------------------------------------------------------------------------------------

    def deploy(self, spec: dict, adapter_dir: Path) -> dict:
        files = {"adapter": ("adapter.tar", pack_adapter(adapter_dir), "application/x-tar")}
        return self._call("POST", "/v1/functions", data={"spec": json.dumps(spec)}, files=files).json()

    @staticmethod
    def pack(adapter_dir: Path) -> bytes:
        """The adapter as `deploy_many` sends it (a tar of its two files)."""
        return pack_adapter(adapter_dir)

    def deploy_many(self, specs: builtins.list[dict], archives: builtins.list[bytes]) -> dict:
        """POST /v1/functions:batch: `specs[i]` with the packed adapter `archives[i]`; the BatchDeployed reply."""
        files = [("adapters", (f"adapter-{i}.tar", archive, "application/x-tar"))
                 for i, archive in enumerate(archives)]
        return self._call("POST", "/v1/functions:batch", data={"specs": json.dumps(specs)}, files=files).json()

    def update(self, name: str, spec: dict, adapter_dir: Path | None = None) -> dict:
        files = {"adapter": ("adapter.tar", pack_adapter(adapter_dir), "application/x-tar")} if adapter_dir else None
        return self._call("PATCH", f"/v1/functions/{name}", data={"spec": json.dumps(spec)}, files=files).json()

    def list(self) -> list[FunctionSpec]:
        return msgspec.json.decode(self._call("GET", "/v1/functions").content, type=FunctionList).functions

    def describe(self, name: str) -> dict:
        return self._call("GET", f"/v1/functions/{name}").json()

    def delete(self, name: str) -> dict:
        return self._call("DELETE", f"/v1/functions/{name}").json()

    def logs(self, name: str, tail: int | None = None, since: float | None = None) -> str:
        params = {k: v for k, v in {"tail": tail, "since": since}.items() if v is not None}
        return self._call("GET", f"/v1/functions/{name}/logs", params=params).text

    # -- invocations -----------------------------------------------------------------------------------------------

    def invoke(self, name: str, body: dict) -> dict:
        return self._call("POST", f"/v1/functions/{name}/invoke", json=body).json()

    def invoke_async(self, name: str, body: dict) -> dict:
        return self._call("POST", f"/v1/functions/{name}/invoke", json=body,
                          headers={"Prefer": "respond-async"}).json()

    def usage(self, since: str | None = None, until: str | None = None, group_by: str = "function") -> dict:
        params = {"group_by": group_by, **{k: v for k, v in {"since": since, "until": until}.items() if v}}
        return self._call("GET", "/v1/usage", params=params).json()

    def invocation(self, invocation_id: str) -> dict:
        return self._call("GET", f"/v1/invocations/{quote(invocation_id, safe='')}").json()

    def cancel_invocation(self, invocation_id: str) -> dict:
        return self._call("DELETE", f"/v1/invocations/{quote(invocation_id, safe='')}").json()

    def invocations(self, function: str | None = None, status: str | None = None, limit: int | None = None
                    ) -> builtins.list[dict]:
        params = {k: v for k, v in {"function": function, "status": status, "limit": limit}.items() if v is not None}
        return self._call("GET", "/v1/invocations", params=params).json()["invocations"]

    def invoke_stream(self, name: str, body: dict) -> Iterator[dict]:
        """Yield the SSE events' JSON documents; an `error` event is raised as its LorafaasError."""
        try:
            with self._http.stream("POST", f"/v1/functions/{name}/invoke", json={**body, "stream": True}) as reply:
                if reply.status_code >= 400:
                    reply.read()
                    self._raise(reply)
                for event in events(reply):
                    if event.error is not None:
                        raise error_class(event.error["code"])(event.error["message"])
                    if event.data is not None:  # (None: an OpenAI stream's closing [DONE], not sent here)
                        yield event.data
        except httpx.TransportError as exc:
            raise PlatformUnavailable(f"lost the connection to lorafaas at {self.url}: {exc}") from exc

    # -- keys ------------------------------------------------------------------------------------------------------

    def create_key(self, tenant: str) -> dict:
        return self._call("POST", "/v1/keys", json={"tenant": tenant}).json()

    def list_keys(self) -> builtins.list[KeyInfo]:
        return msgspec.json.decode(self._call("GET", "/v1/keys").content, type=KeyList).keys

    def revoke_key(self, key_id: str) -> dict:
        return self._call("DELETE", f"/v1/keys/{quote(key_id, safe='')}").json()

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            reply = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise PlatformUnavailable(
                f"cannot reach lorafaas at {self.url} ({exc}); start a local platform with `lorafaas up`"
            ) from exc
        if reply.status_code >= 400:
            self._raise(reply)
        return reply

    @staticmethod
    def _raise(reply: httpx.Response) -> None:
        try:
            error = reply.json()["error"]
            raise error_class(error["code"])(error["message"])
        except (ValueError, KeyError, TypeError):
            raise PlatformUnavailable(f"lorafaas answered HTTP {reply.status_code}: {reply.text[:200]}") from None
