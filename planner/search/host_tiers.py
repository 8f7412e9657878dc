"""Where offloaded chunks' host states go when the host is short: ``cost.evaluate``'s choice.

Every offloaded chunk keeps its home, fp32 master and moments in host memory unless the
host need passes its cap; then, per policy strip of the grid, the fewest of:

- [Homeless chunks] no home (``home_bytes_per_elem`` less, the plan's slots once more),
  last in execution order first (``host_tiers.homeless_order``); each fetch rounds the master
  into a slot on the main thread (``convert_us``, charged serially);
- where every offloaded chunk homeless still misses the cap, either
  [Device homes] master and moments (12 B per element) on the device, first in execution
  order (their CPU steps would be the tail after backward), or, when the plan may use a
  disk (``Terms.nvme_ok``), [NVMe tier] master and moments in a file on disk (12 B per
  element less on the host, plus the mapped window once), in ``homeless_order``: the disk
  traffic of their CPU steps (12 B read, 12 B written per element) lengthens the worker's
  step, and a fetch that reads the master from the disk (homeless, or fp32 where the home
  is the master) reads 4 B per element on the main thread. ``choose`` takes the disk
  where the terms allow it; the search (search.py ``_evaluate``) weighs it against device
  homes (terms without the disk), per strip: no device memory for those states against
  the disk's time.

Given the plan's sets instead (``homeless`` not None), the same figures for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protrain.plans import homes as H

from .memo import last_call


@dataclass(frozen=True)
class Tiers:
    """The choice over a grid of G strips and C chunks."""

    k: np.ndarray  # (G,) homeless chunks
    kd: np.ndarray  # (G,) device-homed chunks
    kn: np.ndarray  # (G,) chunks on disk
    is_homed: np.ndarray  # (G, C) bool
    is_nvme: np.ndarray  # (G, C) bool
    conv_f: (
        np.ndarray
    )  # (G,) µs on the main thread in forward: rounding masters, reading them from disk
    conv_b: np.ndarray  # (G,) the same in backward
    host: np.ndarray  # (G,) host bytes of the offloaded chunks' states, slots, scratch and window
    unhomed: np.ndarray  # (G,) the host need without device homes and the disk


def fetch_reads_disk(t, on_disk, homeless):
    """Whether a fetch of a chunk reads its master from the disk (bools or bool arrays):
    a chunk on disk that is homeless (rounded from the master), or any chunk on disk where
    the compute dtype is fp32 (the home is the master). planner/views/trace.py charges the same."""
    return on_disk & (homeless | t.disk_fetch_with_home)


def homeless_order(off: np.ndarray) -> np.ndarray:
    """The offloaded chunks (``off``: (C,) mask) in the order the search makes them homeless:
    last in execution order first. Those are the chunks still resident at the turn from
    forward to backward, so their masters are rounded for one upload per iteration, not two."""
    return np.nonzero(off)[0][::-1]


def _prefix(values: np.ndarray, k: np.ndarray) -> np.ndarray:
    """(G,) sums of the first ``k`` of ``values`` (each row's own ``k``)."""
    return np.append(0, np.cumsum(values))[k]


_LAST_AT_HOME: list = [None]
"""``(t, (G, host), Tiers)`` of the last ``_all_at_home``: a search asks again for each buffer
count."""


def _all_at_home(t, G: int, host: float) -> Tiers:
    """``choose`` where every strip fits the host with every home kept: no chunk moves (the
    same values ``choose``'s general path gives with all its counts 0). Read-only arrays, the
    last ones again for the same Terms object, grid size and host bytes."""
    return last_call(_LAST_AT_HOME, t, (G, host), lambda: _at_home(t, G, host))


def _at_home(t, G: int, host: float) -> Tiers:
    zero, none = np.zeros(G, dtype=np.int64), np.zeros((G, t.n_chunks), dtype=bool)
    need = np.full(
        G, float(host)
    )  # (no scratch is dropped: kd == n_off only where nothing is offloaded)
    out = Tiers(
        k=zero,
        kd=zero,
        kn=zero,
        is_homed=none,
        is_nvme=none,
        conv_f=np.zeros(G),
        conv_b=np.zeros(G),
        host=need,
        unhomed=need.copy(),
    )
    for a in (zero, none, need, out.conv_f, out.conv_b, out.unhomed):
        a.flags.writeable = False
    return out


def choose(
    t,
    off: np.ndarray,
    host: float,
    host_swap: np.ndarray,
    host_cap: float,
    uploads_f: np.ndarray,
    uploads_b: np.ndarray,
    homeless: Sequence[int] | None,
    homed: Sequence[int],
    nvme: Sequence[int],
) -> Tiers:
    """``t``: cost.Terms; ``off``: (C,) offloaded mask; ``host``: the host need with every home
    kept (scratch included); ``uploads_f``/``uploads_b``: (C,) uploads of each chunk per pass."""
    C, G = t.n_chunks, len(host_swap)
    if homeless is None and not (host + host_swap - host_cap > 0).any():
        return _all_at_home(t, G, host)
    n_off = int(off.sum())
    offs = np.nonzero(off)[0]  # offloaded chunks in execution order: the kd first are device-homed
    first = homeless_order(off)  # the k first of these are homeless, the kn first on disk
    numel = t.host_numel.astype(np.float64)
    disk_read = (
        uploads_f * numel * t.disk_fetch_us_per_elem,
        uploads_b * numel * t.disk_fetch_us_per_elem,
    )
    if homeless is None:
        over = host + host_swap - host_cap  # (G,)
        k = np.zeros(G, dtype=np.int64)
        saved = np.cumsum(t.host_numel[first] * t.home_bytes_per_elem)  # (n_off,) by the first k
        homeless_on = t.homeless_ok and n_off and t.home_bytes_per_elem
        if homeless_on:
            k = np.where(
                over > 0, np.minimum(np.searchsorted(saved, over + t.slot_pool_bytes) + 1, n_off), 0
            )
        kd = kn = np.zeros(G, dtype=np.int64)
        left = (
            over - np.append(0, saved)[k] + (k > 0) * t.slot_pool_bytes
        )  # what homeless chunks leave
        if t.nvme_ok and n_off:
            per = np.cumsum(t.host_numel[first] * t.disk_saves_per_elem)
            kn = np.where(
                left > 0, np.minimum(np.searchsorted(per, left + H.NVME_WINDOW) + 1, n_off), 0
            )
        elif t.homed_ok and n_off:
            per = t.host_numel[offs] * (
                t.host_bytes_per_elem - (t.home_bytes_per_elem if homeless_on else 0)
            )
            kd = np.where(left > 0, np.minimum(np.searchsorted(np.cumsum(per), left) + 1, n_off), 0)
        unhomed = (
            host - np.append(0, saved)[k] + (k > 0) * t.slot_pool_bytes
        )  # the host need without them
        k = np.minimum(k, n_off - kd)  # a device-homed chunk is not homeless
        rank = np.full(C, C, dtype=np.int64)
        rank[offs] = np.arange(n_off)
        is_homed = rank[None, :] < kd[:, None]  # (G, C)
        back = np.full(C, C, dtype=np.int64)
        back[first] = np.arange(n_off)
        is_nvme = back[None, :] < kn[:, None]  # (G, C)
        conv_f = _prefix(uploads_f[first], k) * t.convert_us
        conv_b = _prefix(uploads_b[first], k) * t.convert_us
        reads = kn if t.disk_fetch_with_home else np.minimum(k, kn)  # fetches that read the disk
        conv_f = conv_f + _prefix(disk_read[0][first], reads)
        conv_b = conv_b + _prefix(disk_read[1][first], reads)
        dropped = np.append(0, saved)[k]
    else:
        h = np.zeros(C, dtype=np.int64)
        h[list(homeless)] = 1
        k = np.full(G, int(h.sum()), dtype=np.int64)
        is_homed = np.zeros((G, C), dtype=bool)
        is_homed[:, list(homed)] = True
        is_nvme = np.zeros((G, C), dtype=bool)
        is_nvme[:, list(nvme)] = True
        kd, kn = np.full(G, len(homed), dtype=np.int64), np.full(G, len(nvme), dtype=np.int64)
        reads = fetch_reads_disk(t, is_nvme[0], h.astype(bool))
        conv_f = np.full(G, float(uploads_f @ h) * t.convert_us + float(disk_read[0] @ reads))
        conv_b = np.full(G, float(uploads_b @ h) * t.convert_us + float(disk_read[1] @ reads))
        dropped = np.full(G, float(t.host_numel @ h) * t.home_bytes_per_elem)
        unhomed = None
    mask = is_homed.astype(np.float64)
    host = (
        host
        - dropped
        + (k > 0) * t.slot_pool_bytes
        - mask @ (t.host_numel * t.host_bytes_per_elem)
        - is_nvme @ (t.host_numel * t.disk_saves_per_elem)
        + (kn > 0) * H.NVME_WINDOW
    )  # (G,)
    unhomed = host if unhomed is None else unhomed
    host = host - (kd == n_off) * (
        t.host_scratch_bytes if n_off else 0
    )  # nothing left to step on the host
    return Tiers(
        k=k,
        kd=kd,
        kn=kn,
        is_homed=is_homed,
        is_nvme=is_nvme,
        conv_f=conv_f,
        conv_b=conv_b,
        host=host,
        unhomed=unhomed,
    )
