"""Pods as one watch sees them: the informer pattern of client-go, which the Python client lacks.

`Reflector` lists a collection, then watches it from the list's resourceVersion, and lists again after a 410 Gone, a
broken stream or a read timeout (every call carries a client-side `_request_timeout`, so a half-open connection fails
instead of blocking the thread forever); it runs in a daemon thread and hands every object to callbacks. `PodCache`
keeps the latest state of each pod it reflects, so that readers (placement, readiness, liveness) never call the API
server, and lets a thread (`wait_for`) or a coroutine (`wait_until`, which holds no thread) wait for a pod to reach a
state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from lorafaas.platform.backends.pod_status import pod_name_of

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 240  # the server ends a watch after this; the reflector resumes from the last resourceVersion
# The client's own limits on each call, so that a connection that went silent (half-open: a peer or a middlebox gone
# without a FIN) fails instead of blocking the reflector forever: connecting, and waiting for the next bytes a bit
# longer than the server takes to end a quiet watch.
CONNECT_TIMEOUT_S = 10.0
READ_GRACE_S = 5.0
RETRY_S = 1.0


class Reflector:
    """`list_func(*args, **kwargs)` listed, then watched, until `stop()`. `on_list(items)` after every list (the whole
    collection: a replace), `on_event(type, obj)` for each ADDED, MODIFIED and DELETED."""

    def __init__(
        self,
        name: str,
        list_func: Callable,
        *args,
        on_list: Callable[[list], None],
        on_event: Callable[[str, Any], None],  # a model object of whatever list_func lists
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        **kwargs,
    ) -> None:
        self.name = name
        self.list_func, self.args, self.kwargs = list_func, args, kwargs
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout = (CONNECT_TIMEOUT_S, watch_timeout_s + READ_GRACE_S)  # urllib3's (connect, read)
        self.on_list, self.on_event = on_list, on_event
        self.synced = threading.Event()  # set after the first successful list
        self._stopped = threading.Event()
        self._watch: k8s_watch.Watch | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"reflector-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()  # shuts the socket down: a blocked read returns at once
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                listing = self.list_func(*self.args, _request_timeout=self.request_timeout, **self.kwargs)
                self.on_list(list(listing.items))
                self.synced.set()
                self._follow(listing.metadata.resource_version)
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: the version is too old; listing again is the recovery
                    log.warning("%s: the API server answered %s %s; listing again in %.0f s", self.name, exc.status,
                                exc.reason, RETRY_S)
                    self._stopped.wait(RETRY_S)
            except (urllib3.exceptions.HTTPError, OSError) as exc:  # a read timeout is one: listed again
                if not self._stopped.is_set():
                    log.warning("%s: watch broken (%s); listing again in %.0f s", self.name, exc, RETRY_S)
                    self._stopped.wait(RETRY_S)
            except Exception:  # a long-lived thread: a bug in a callback must not silently end the watch
                log.exception("%s: unexpected error; listing again in %.0f s", self.name, RETRY_S)
                self._stopped.wait(RETRY_S)

    def _follow(self, resource_version: str) -> None:
        while not self._stopped.is_set():
            self._watch = k8s_watch.Watch()
            for event in self._watch.stream(self.list_func, *self.args, resource_version=resource_version,
                                            timeout_seconds=self.watch_timeout_s,
                                            _request_timeout=self.request_timeout, **self.kwargs):
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    self.on_event(event["type"], event["object"])
                if self._stopped.is_set():
                    return
            resource_version = self._watch.resource_version or resource_version


class PodCache:
    """The pods one label selector picks in a namespace, kept current by a `Reflector`. `on_change(pod, deleted)`
    sees every state (from lists and events), in the watch thread."""

    def __init__(
        self,
        core: k8s.CoreV1Api,
        namespace: str,
        label_selector: str,
        on_change: Callable[[k8s.V1Pod, bool], None] | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self._pods: dict[str, k8s.V1Pod] = {}
        self._changed = threading.Condition()
        self._wakers: set[Callable[[], None]] = set()  # of the coroutines in `wait_until`, called on every change
        self._on_change = on_change
        self.reflector = Reflector(f"pods {namespace}/{label_selector}", core.list_namespaced_pod, namespace,
                                   label_selector=label_selector, on_list=self._replace, on_event=self._apply,
                                   watch_timeout_s=watch_timeout_s)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start following and return once the first list is in (or raise TimeoutError)."""
        if not self.reflector.running:
            self.reflector.start()
        if not self.reflector.synced.wait(timeout_s):
            raise TimeoutError(f"{self.reflector.name}: no list from the API server within {timeout_s:.0f} s")

    def stop(self) -> None:
        self.reflector.stop()

    @property
    def started(self) -> bool:
        return self.reflector.running

    def pods(self) -> list[k8s.V1Pod]:
        with self._changed:
            return list(self._pods.values())

    def get(self, name: str) -> k8s.V1Pod | None:
        with self._changed:
            return self._pods.get(name)

    def wait_for(self, name: str, done: Callable[[k8s.V1Pod | None], bool], timeout_s: float) -> k8s.V1Pod | None:
        """Block until `done(pod)` holds for the named pod (None: it does not exist) or timeout_s passes; the pod as
        last seen either way."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done(self._pods.get(name)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 1.0))
            return self._pods.get(name)

    async def wait_until(self, name: str, done: Callable[[k8s.V1Pod | None], bool],
                         timeout_s: float) -> k8s.V1Pod | None:
        """`wait_for` for a coroutine: it awaits the watch's changes (the watch thread wakes its event loop) and holds
        no thread meanwhile, however long the pod takes."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:  # in the watch thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(changed.set)

        with self._changed:
            self._wakers.add(wake)
        try:
            deadline = loop.time() + timeout_s
            while True:
                changed.clear()  # before reading: a change after the read wakes the wait below
                pod = self.get(name)
                left = deadline - loop.time()
                if done(pod) or left <= 0:
                    return pod
                with contextlib.suppress(TimeoutError):  # at least each second: `done` may read more than the pod
                    await asyncio.wait_for(changed.wait(), min(left, 1.0))
        finally:
            with self._changed:
                self._wakers.discard(wake)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def _replace(self, items: list[k8s.V1Pod]) -> None:
        with self._changed:
            self._pods, before = {pod_name_of(pod): pod for pod in items}, self._pods
            gone = [pod for name, pod in before.items() if name not in self._pods]
        self._wake()
        if self._on_change is not None:
            for pod in gone:
                self._on_change(pod, True)
            for pod in items:
                self._on_change(pod, False)

    def _apply(self, kind: str, pod: k8s.V1Pod) -> None:
        with self._changed:
            if kind == "DELETED":
                self._pods.pop(pod_name_of(pod), None)
            else:
                self._pods[pod_name_of(pod)] = pod
        self._wake()
        if self._on_change is not None:
            self._on_change(pod, kind == "DELETED")
