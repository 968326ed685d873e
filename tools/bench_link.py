#!/usr/bin/env python3
"""GPU-side links between two devices through host pages (``tools/flags.py``, :mod:`vkxsplit.ops.link`): does a
spinning dispatch on one device see a flag the other writes, how long a rendezvous takes, and
whether data published before the flag arrives whole.

Three tables:

- ``groups``: the instance's physical device groups (VK_KHR_device_group: one VkDevice over
  several GPUs, peer memory) and the pair's UUIDs;
- ``rendezvous``: both devices run ``N`` rounds of (signal my flag = i, wait for the peer's
  flag >= i), one dispatch each, all in one submit per device: time per round, polls, give-ups;
- ``all-reduce``: both devices, ``N`` rounds of: fill a partial with a value of (round, device),
  copy it into its half of the host pages (slot by round parity), publish barrier, rendezvous,
  ``link_sum`` (own + peer's, volatile loads), accumulate; the accumulated sum is compared with
  the exact one (every value an integer: any stale or torn read shows).

  python tools/bench_link.py --devices 0,1            # two GPUs
  python tools/bench_link.py --devices 0,0 --quick    # lavapipe: two VkDevices on one device
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from flags import record_link  # noqa: E402

from vkxsplit.hubs import HostLink  # noqa: E402
from vkxsplit.ops.copy import record_copy  # noqa: E402
from vkxsplit.ops.elementwise import record_add  # noqa: E402
from vkxsplit.ops.link import record_link_sum  # noqa: E402
from vkxsplit.vk.api import ffi, lib, new, string  # noqa: E402
from vkxsplit.vk.command import Sequence  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402
from vkxsplit.vk.kernel import View  # noqa: E402

FLAGS = 4096  # the flag words' share of the pages (each flag on its own 256 bytes)


def device_groups(dev: Device) -> list[list[str]]:
    inst = dev.instance.handle
    n = ffi.new("uint32_t*")
    lib.vkEnumeratePhysicalDeviceGroups(inst, n, ffi.NULL)
    arr = ffi.new(f"VkPhysicalDeviceGroupProperties[{n[0]}]")
    for i in range(n[0]):
        arr[i].sType = 1000070000  # VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_GROUP_PROPERTIES
    lib.vkEnumeratePhysicalDeviceGroups(inst, n, arr)
    out = []
    for i in range(n[0]):
        names = []
        for j in range(arr[i].physicalDeviceCount):
            props = new("VkPhysicalDeviceProperties")
            lib.vkGetPhysicalDeviceProperties(arr[i].physicalDevices[j], props)
            names.append(string(props.deviceName))
        out.append(names + [f"subsetAllocation={bool(arr[i].subsetAllocation)}"])
    return out


class Pair:
    """Two devices, host pages both import: flags at 0 and 256, status words per device,
    data slots after FLAGS: [device][parity] of ``slot`` bytes each."""

    def __init__(self, sels: list[str], slot: int) -> None:
        self.devs = [Device.open(int(s) if s.isdigit() else s) for s in sels]
        self.slot = slot
        self.link = HostLink(self.devs[:2], FLAGS + 4 * slot, "bench-link")
        self.pages = self.link.views  # the same bytes, seen by device 0 / 1
        self.base = [d.memory.alloc(256, "host", "base") for d in self.devs]
        self.status = [d.memory.alloc(256, "host", "status") for d in self.devs]

    def flag(self, d: int, owner: int):
        return View(self.pages[d], 256 * owner, 4)

    def data(self, d: int, owner: int, parity: int):
        return View(self.pages[d], FLAGS + (2 * owner + parity) * self.slot, self.slot)

    def reset(self, base: int) -> None:
        m = self.link.mapping
        view = np.frombuffer(ffi.buffer(ffi.cast("char*", m.addr), FLAGS), np.uint32)
        view[:] = 0
        for d in range(2):
            self.base[d].numpy(np.uint32)[:] = base
            self.status[d].numpy(np.uint32)[:] = 0

    def run(self, seqs: list[Sequence], timeout: float = 120.0) -> float:
        t0 = time.perf_counter()
        for s in seqs:
            s.submit()
        for s in seqs:
            s.wait(timeout)
        return time.perf_counter() - t0

    def close(self) -> None:
        for b in self.base + self.status:
            b.close()
        self.link.close()
        for d in self.devs:
            d.close()


def rendezvous(pair: Pair, rounds: int, poll: str, max_spins: int) -> dict:
    seqs = []
    for d in range(2):
        s = Sequence(pair.devs[d], f"rendezvous{d}")
        for i in range(1, rounds + 1):
            record_link(s, pair.flag(d, 1 - d), pair.flag(d, d), pair.base[d], pair.status[d],
                        offset=i, max_spins=max_spins, poll=poll)
        s.end()
        seqs.append(s)
    try:
        pair.reset(1)
        pair.run(seqs)  # warm
        best = None
        for _ in range(3):
            pair.reset(1)
            t = pair.run(seqs)
            best = t if best is None else min(best, t)
        st = [pair.status[d].numpy(np.uint32)[:2].tolist() for d in range(2)]
        return {"poll": poll, "rounds": rounds, "us_per_round": best / rounds * 1e6,
                "gave_up": [s[0] for s in st], "polls": [s[1] for s in st]}
    finally:
        for s in seqs:
            s.close()


def allreduce(pair: Pair, n: int, rounds: int, poll: str, max_spins: int) -> dict:
    nbytes = 4 * n
    bufs = []
    seqs = []
    for d in range(2):
        mem = pair.devs[d].memory
        part, tmp, acc = (mem.alloc(nbytes, "device", nm) for nm in ("part", "tmp", "acc"))
        bufs.append((part, tmp, acc))
        s = Sequence(pair.devs[d], f"allreduce{d}")
        s.fill(acc, 0)
        for i in range(1, rounds + 1):
            value = float(i + 1000 * d)
            s.fill(part, struct.unpack("<I", struct.pack("<f", value))[0])
            record_copy(s, part, pair.data(d, d, i % 2), nbytes)
            s.publish_barrier()
            record_link(s, pair.flag(d, 1 - d), pair.flag(d, d), pair.base[d], pair.status[d],
                        offset=i, max_spins=max_spins, poll=poll)
            record_link_sum(s, part, pair.data(d, 1 - d, i % 2), tmp, n)
            record_add(s, acc, tmp, acc, 1, n, b_rows=1)
        s.end()
        seqs.append(s)
    try:
        pair.reset(1)
        pair.run(seqs)  # warm
        pair.reset(1)
        t = pair.run(seqs)
        want = float(sum(2 * i + 1000 for i in range(1, rounds + 1)))
        bad = [int(np.count_nonzero(b[2].numpy(np.float32)[:n] != want)) if b[2].host_visible
               else _bad_staged(b[2], n, want) for b in bufs]
        st = [pair.status[d].numpy(np.uint32)[:2].tolist() for d in range(2)]
        return {"poll": poll, "bytes": nbytes, "rounds": rounds, "us_per_round": t / rounds * 1e6,
                "wrong": bad, "gave_up": [s[0] for s in st], "polls": [s[1] for s in st]}
    finally:
        for s in seqs:
            s.close()
        for b3 in bufs:
            for b in b3:
                b.close()


def host_rendezvous(pair: Pair, rounds: int, spin: bool, n: int = 4096) -> dict:
    """The same rendezvous and data exchange with the host in between: device d's round i is
    one submit (sum of round i - 1's partials, then fill and publish round i's) that waits for
    ``go_d >= i - 1`` and signals ``done_d = i``; a host thread waits for both ``done`` values
    (polling the counters when ``spin``, else vkWaitSemaphores) and signals both ``go``."""
    import threading

    from vkxsplit.vk.event import Timeline

    nbytes = 4 * n
    done = [Timeline(d, name="done") for d in pair.devs]
    go = [Timeline(d, name="go") for d in pair.devs]
    bufs, seqs = [], []
    try:
        for d in range(2):
            mem = pair.devs[d].memory
            part, tmp, acc = (mem.alloc(nbytes, "device", nm) for nm in ("part", "tmp", "acc"))
            bufs.append((part, tmp, acc))
            per = []
            for i in range(1, rounds + 2):
                s = Sequence(pair.devs[d], f"host-rdv{d}:{i}")
                if i == 1:
                    s.fill(acc, 0)
                else:
                    record_link_sum(s, part, pair.data(d, 1 - d, (i - 1) % 2), tmp, n)
                    record_add(s, acc, tmp, acc, 1, n, b_rows=1)
                if i <= rounds:
                    s.fill(part, struct.unpack("<I", struct.pack("<f", float(i + 1000 * d)))[0])
                    record_copy(s, part, pair.data(d, d, i % 2), nbytes)
                s.end()
                per.append(s)
            seqs.append(per)

        def host() -> None:
            for i in range(1, rounds + 1):
                for d in range(2):
                    if spin:
                        end = time.monotonic() + 60
                        while done[d].value < i:
                            if time.monotonic() > end:
                                return  # (the main thread's wait reports it)
                    else:
                        done[d].wait(i, 60)
                for d in range(2):
                    go[d].signal(i)

        t0 = time.perf_counter()
        th = threading.Thread(target=host, daemon=True)
        th.start()
        for i in range(rounds + 1):
            for d in range(2):
                seqs[d][i].submit(waits=[(go[d], i)] if i else [], signals=[(done[d], i + 1)])
        th.join(120)
        for d in range(2):
            seqs[d][-1].wait(60)
        t = time.perf_counter() - t0
        want = float(sum(2 * i + 1000 for i in range(1, rounds + 1)))
        bad = [_bad_staged(b[2], n, want) for b in bufs]
        return {"spin": spin, "rounds": rounds, "us_per_round": t / rounds * 1e6, "wrong": bad}
    finally:
        for per in seqs:
            for s in per:
                s.close()
        for b3 in bufs:
            for b in b3:
                b.close()
        for tl in done + go:
            tl.close()


def bar_rendezvous(pair: Pair, rounds: int, max_spins: int) -> str:
    """Each device's incoming flag in its own host-visible device-local memory (the BAR), the
    other device writing it through an import of that mapping as a host pointer (where the driver
    takes such a pointer). Polls then read the poller's own memory."""
    from vkxsplit.attach import host_page_align, import_host_pages
    from vkxsplit.vk.memory import Buffer

    size = 1 << 16
    own, imp, blocks = [], [], []
    try:
        for d in range(2):
            buf = pair.devs[d].memory.alloc(4 * size, "upload", "bar")
            own.append(buf)
            if not buf.block.device_local:
                return "no device-local host-visible memory"
        for d in range(2):
            src = own[1 - d]
            addr = int(ffi.cast("uintptr_t", src.block.ptr)) + src.offset
            al = max(host_page_align(pair.devs[d]), size)
            a = -(-addr // al) * al
            try:
                blk = import_host_pages(pair.devs[d], a, size, "bar-import")
            except Exception as exc:  # noqa: BLE001 (report whatever the driver says)
                return f"refused: {type(exc).__name__}: {str(exc)[:200]}"
            blocks.append(blk)
            imp.append((Buffer(blk, 0, size, "bar-peer"), a - addr))
        seqs = []
        for d in range(2):
            s = Sequence(pair.devs[d], f"bar{d}")
            in_off = imp[1 - d][1]  # where the peer's import of my BAR starts in my buffer
            for i in range(1, rounds + 1):
                record_link(s, View(own[d], in_off + 256 * (1 - d), 4), View(imp[d][0], 256 * d, 4),
                            pair.base[d], pair.status[d], offset=i, max_spins=max_spins, poll="volatile")
            s.end()
            seqs.append(s)
        for d in range(2):
            np.frombuffer(ffi.buffer(ffi.cast("char*", int(ffi.cast("uintptr_t", own[d].block.ptr))
                                         + own[d].offset), 4 * size), np.uint8)[:] = 0
        pair.reset(1)
        t = pair.run(seqs)
        st = [pair.status[d].numpy(np.uint32)[:2].tolist() for d in range(2)]
        for sq in seqs:
            sq.close()
        return f"{t / rounds * 1e6:.1f} us per rendezvous, gave up {[x[0] for x in st]}, polls {[x[1] for x in st]}"
    finally:
        for b in blocks:
            b.close()
        for b in own:
            b.close()


def _bad_staged(buf, n: int, want: float) -> int:
    from vkxsplit.vk.command import staged_download

    a = staged_download(buf, 0, 4 * n).view(np.float32)
    return int(np.count_nonzero(a != want))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--polls", default="volatile,atomic")
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--sizes", default="16K,1M,8M", help="all-reduce sizes in bytes (K, M suffixes)")
    ap.add_argument("--max-spins", type=int, default=1 << 24)
    ap.add_argument("--quick", action="store_true", help="few rounds, small sizes (lavapipe)")
    a = ap.parse_args()
    kernels.ensure("^link_flag_")  # the flag rendezvous (tools/flags.py), built where missing
    if a.quick:
        a.rounds, a.sizes, a.polls, a.max_spins = 20, "16K", "atomic", 1 << 20
    sizes = [int(s[:-1]) * (1024 if s[-1] in "kK" else 1 << 20) if s[-1] in "kKmM" else int(s)
             for s in a.sizes.split(",")]
    pair = Pair(a.devices.split(","), max(sizes))
    try:
        d0, d1 = pair.devs
        print(f"devices: {d0.name} / {d1.name}; same deviceUUID: "
              f"{d0.physical.device_uuid == d1.physical.device_uuid}")
        print("physical device groups:", device_groups(d0))
        print("flags in each device's BAR, written by the peer through a host-pointer import:",
              bar_rendezvous(pair, a.rounds, a.max_spins))
        print("\n| host relay | rounds | us per round | wrong (dev0, dev1) |")
        print("|---|---:|---:|---|")
        for spin in (True, False):
            r = host_rendezvous(pair, min(a.rounds, 500), spin)
            print(f"| {'spin' if spin else 'vkWaitSemaphores'} | {r['rounds']} | {r['us_per_round']:.1f} "
                  f"| {r['wrong']} |", flush=True)
        print("\n| poll | rounds | us per rendezvous | polls (dev0, dev1) | gave up |")
        print("|---|---:|---:|---|---|")
        for poll in a.polls.split(","):
            r = rendezvous(pair, a.rounds, poll, a.max_spins)
            print(f"| {poll} | {r['rounds']} | {r['us_per_round']:.1f} | {r['polls']} | {r['gave_up']} |",
                  flush=True)
        print("\n| poll | bytes | rounds | us per all-reduce | GB/s each way | wrong (dev0, dev1) | gave up |")
        print("|---|---:|---:|---:|---:|---|---|")
        for poll in a.polls.split(","):
            for n in sizes:
                rounds = max(4, min(a.rounds, (256 << 20) // n))
                r = allreduce(pair, n // 4, rounds, poll, a.max_spins)
                gbs = n / (r["us_per_round"] * 1e-6) / 1e9
                print(f"| {poll} | {n} | {rounds} | {r['us_per_round']:.1f} | {gbs:.1f} | {r['wrong']} "
                      f"| {r['gave_up']} |", flush=True)
    finally:
        pair.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
