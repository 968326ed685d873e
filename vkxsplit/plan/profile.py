"""The device profile: measured costs of one hub device, as JSON under the cache dir.

A profile is keyed by the hub's device UUID, driver version and kernels (:func:`kernels_ident`:
every shipped SPIR-V module's hash and the kill switches set, gathered by :func:`_hub_ident`);
when any of them changes, what was measured no longer applies and is measured again
(:mod:`vkxsplit.calibrate`). :class:`vkxsplit.plan.cost.CostModel` reads it.

Imports: ``vkxsplit.shaders``, ``vkxsplit.vk.instance`` and ``vkxsplit.vk.device`` (lazily).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from ..cachefile import atomic_write
from ..features import kernel_config_ident

log = logging.getLogger("vkxsplit.plan")

PROFILE_VERSION = 2

def _hub_ident(device: Any) -> dict[str, Any]:
    p = device.physical
    return {"device": device.name, "device_uuid": bytes(p.device_uuid).hex(), "driver_version": int(p.driver_version),
            "kernels": kernel_config_ident(device)}


class Profile:
    """Measured costs of one hub device, as JSON under the cache dir. The file name and its
    content carry the device UUID, driver version and kernels
    (:func:`vkxsplit.features.kernel_config_ident`): when
    any changes, what was measured no longer applies and is measured again."""

    def __init__(self, path: Path | None = None, ident: dict[str, Any] | None = None) -> None:
        self.path = path
        self.ident = ident or {}
        self.entries: dict[str, dict[str, Any]] = {}
        self.stale_reason: str | None = None
        self.dirty = False

    @classmethod
    def for_device(cls, device: Any, directory: str | Path | None = None) -> Profile:
        from ..vk.device import cache_dir

        ident = _hub_ident(device)
        key = hashlib.sha256(f"{ident['device_uuid']}:{ident['driver_version']}:{ident['kernels']}".encode()
                             ).hexdigest()[:16]
        p = cls(Path(directory or cache_dir()) / f"profile-{key}.json", ident)
        p._load()
        return p

    def _load(self) -> None:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.stale_reason = f"unreadable ({exc})"
            return
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            self.stale_reason = "another profile format"
            return
        for k in ("device_uuid", "driver_version", "kernels"):
            if data.get(k) != self.ident.get(k):
                self.stale_reason = f"{k} changed ({data.get(k)} -> {self.ident.get(k)})"
                return
        self.entries = {k: dict(v) for k, v in data.get("entries", {}).items() if isinstance(v, dict)}

    def get(self, scope: str, key: str) -> Any:
        return self.entries.get(scope, {}).get(key)

    def put(self, scope: str, key: str, value: Any) -> None:
        self.entries.setdefault(scope, {})[key] = value
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        data = {"version": PROFILE_VERSION, **self.ident, "entries": self.entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True))
            self.dirty = False
        except OSError as exc:
            log.warning("cannot save the device profile %s: %s", self.path, exc)


__all__ = ["PROFILE_VERSION", "Profile"]
