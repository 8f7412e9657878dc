"""Parity again with delays injected before copies, CPU AdamW steps and weight returns.

The CPU AdamW worker overlaps backward and the next forward; the only thing that
keeps the next forward from reading stale or half-written weights is the wait in
``ChunkStore.fetch``. Delays make a missing wait fail deterministically instead of
passing by luck — and the last test proves it by removing the wait.
"""

from __future__ import annotations

import pytest
from harness import lockstep, make_plan

from protrain.executor import transfer
from protrain.executor.chunks import ChunkStore, Residency


@pytest.fixture
def delays(monkeypatch):
    def set_delays(**seconds):
        for k, v in seconds.items():
            monkeypatch.setitem(transfer.DELAYS, k, v)

    return set_delays


CASES = [
    ("gpt2-4", [], 2, "keep"),
    ("llama-4", [0], 2, "swap checkpoint keep swap"),
]


@pytest.mark.parametrize("which", ["before_copy", "before_cpu_adam", "before_weights_return"])
@pytest.mark.parametrize("model,persistent,n_buffer,policies", CASES)
def test_parity_with_delays(delays, which, model, persistent, n_buffer, policies):
    delays(**{which: 0.002 if which == "before_copy" else 0.02})
    plan = make_plan(model, persistent=persistent, n_buffer=n_buffer, policies=policies)
    run = lockstep(model, plan, steps=4)
    assert run.losses == run.ref_losses


def test_a_missing_wait_shows_up_as_a_mismatch(delays, monkeypatch):
    """Fetch without waiting for the chunk's CPU step: with the delay, losses must differ."""

    def fetch_without_wait(self, cid):
        c = self.chunks[cid]
        if c.residency is Residency.RESIDENT:
            return
        c.update = None  # the bug: forget the pending CPU step
        self._resize(c.dev, c.nbytes)
        self._refresh_live()
        self.ledger.alloc("chunks", c.nbytes)
        c.upload = self.copies.upload(c.dev, c.home)
        c.residency = Residency.RESIDENT

    monkeypatch.setattr(ChunkStore, "fetch", fetch_without_wait)
    delays(before_weights_return=0.05)
    run = lockstep("gpt2-4", make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep"), steps=3)
    run.engine.optim.wait_all()
    assert run.losses[0] == run.ref_losses[0]  # the first forward reads the initial weights
    assert run.losses[1:] != run.ref_losses[1:]
