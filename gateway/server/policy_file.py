"""The live policy: loaded from a file, swapped atomically on edit or SIGHUP, old one kept on a bad reload."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from gateway.policy import model as policy_module
from gateway.policy.model import Policy, PolicyError

log = logging.getLogger(__name__)


class PolicyFile:
    """Holds the current Policy; readers take `current` once per request and keep that reference."""

    def __init__(self, path: str, on_reload: Callable[[Policy | None, PolicyError | None], None]) -> None:
        self.path = path
        self.current: Policy = policy_module.load(path)
        self.generation = 1
        self.last_error: PolicyError | None = None
        self._on_reload = on_reload
        self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple[float, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime, st.st_size, st.st_ino)

    def reload(self) -> bool:
        """Validate the file and swap it in; on failure keep serving the old policy and remember why."""
        self._stamp = self._file_stamp()
        try:
            new = policy_module.load(self.path)
        except PolicyError as exc:
            self.last_error = exc
            log.error("policy reload failed, keeping the previous policy:\n%s", exc)
            self._on_reload(None, exc)
            return False
        self.current = new
        self.generation += 1
        self.last_error = None
        log.info("policy reloaded from %s (generation %d)", self.path, self.generation)
        self._on_reload(new, None)
        return True

    async def watch(self, poll_s: float) -> None:
        """Poll the file's stamp (a ConfigMap update swaps a symlink, which inotify on the file misses)."""
        while True:
            await asyncio.sleep(poll_s)
            stamp = self._file_stamp()
            if stamp is not None and stamp != self._stamp:
                self.reload()

    def describe(self) -> dict[str, object]:
        return {
            "path": str(Path(self.path)),
            "generation": self.generation,
            "last_reload_error": None if self.last_error is None else self.last_error.problems,
        }
