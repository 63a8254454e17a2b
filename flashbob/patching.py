"""Thread-aware patches of a torch function by a flashbob drop-in: :func:`flashbob.patch_sdpa` and
:func:`flashbob.patch_flex_attention` are :class:`Patch` subclasses of one :class:`Route` each."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

from flashbob.inputs import check_backend


class Route:
    """One patched function, process-wide: where it lives (``owner.name``), the function it replaced, how many
    patches are open in all threads, and each thread's open patches (innermost last). While any patch is open,
    ``owner.name`` is a function that calls ``drop_in(..., backend=...)`` with the backend of this thread's innermost
    patch, or the replaced function in a thread without one."""

    def __init__(self, owner, name: str, drop_in: Callable, patched: Callable):
        self.owner, self.name, self.drop_in, self.patched = owner, name, drop_in, patched
        self.lock = threading.Lock()
        self.original = None
        self.open_count = 0
        self.local = threading.local()

    def stack(self) -> list:
        """This thread's open patches, innermost last."""
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def call(self, *args, **kwargs):
        """The patched function's body: the drop-in with this thread's innermost patch's backend, else the
        replaced function."""
        stack = self.stack()
        if not stack:
            return self.original(*args, **kwargs)
        return self.drop_in(*args, backend=stack[-1].backend, **kwargs)

    def open(self, patch) -> None:
        with self.lock:
            if self.open_count == 0:
                self.original = getattr(self.owner, self.name)
                setattr(self.owner, self.name, self.patched)
            self.open_count += 1
        self.stack().append(patch)

    def close(self, patch, what: str) -> None:
        stack = self.stack()
        if patch not in stack:
            raise RuntimeError(f"{what}: this patch is not open in this thread (closed twice, or never entered here)")
        del stack[len(stack) - 1 - stack[::-1].index(patch)]  # this patch's innermost entry, wherever it is
        with self.lock:
            self.open_count -= 1
            if self.open_count == 0:
                if getattr(self.owner, self.name) is self.patched:  # unless someone replaced it meanwhile
                    setattr(self.owner, self.name, self.original)
                # self.original stays: a thread that looked the patch up just before may still call through it


class Patch(contextlib.ContextDecorator):
    """A context manager and a decorator that routes its class's :class:`Route` through the drop-in, in the thread
    that opened it, until it closes (also on errors). Patches nest (the innermost one's ``backend`` applies) and
    may close in any order; other threads keep the original function meanwhile, and the last patch to close, in any
    thread, puts it back. Code that imported the function by name before patching keeps the original."""

    route: Route

    def __init__(self, backend: str = "auto"):
        check_backend(backend)
        self.backend = backend

    def __enter__(self):
        self.route.open(self)
        return self

    def __exit__(self, *exc):
        self.route.close(self, type(self).__name__)
        return False
