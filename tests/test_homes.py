"""The homes and policies table (plans/homes.py): the bytes each home keeps, its traffic and
preconditions, written out here as sums of named terms so that an edit of an entry shows.

The executor's ledger is held to the accounting stream (which reads this table) at every step
of every training test; this file pins the table itself.
"""

from __future__ import annotations

import pytest

from protrain.plans import homes as H
from protrain.plans.errors import PlanError

BF16, FP32 = H.Setup("bfloat16"), H.Setup("float32")
BF16_ACC2, FP32_ACC2 = H.Setup("bfloat16", 2), H.Setup("float32", 2)


@pytest.mark.parametrize(
    "setup,host,persistent",
    [
        # host: home (cb) + master (16-bit only) + two moments (8) + fp32 accumulator (4 unless the
        # gradients land in the home: 16-bit, no accumulation) + staging (cb, accumulation only)
        (BF16, 2 + 4 + 8, 2 + 2 + 4 + 8),
        (FP32, 4 + 0 + 8 + 4, 4 + 4 + 0 + 8),
        (BF16_ACC2, 2 + 4 + 8 + 4 + 2, 2 + 2 + 4 + 8),
        (FP32_ACC2, 4 + 0 + 8 + 4 + 4, 4 + 4 + 0 + 8),
    ],
)
def test_bytes_per_element_of_a_trainable_chunk(setup, host, persistent):
    assert H.HOST.per_elem(setup, "host") == host and H.HOST.per_elem(setup, "device") == 0
    # persistent: values and gradients (cb each) + master (16-bit only) + moments, all on the device
    assert (
        H.PERSISTENT.per_elem(setup, "device") == persistent
        and H.PERSISTENT.per_elem(setup, "host") == 0
    )
    # homeless: the host home less; device-homed: master and moments (12 B) on the device, nothing
    # on the host
    assert H.HOMELESS.per_elem(setup, "host") == host - setup.cb
    assert (H.DEVICE_HOMED.per_elem(setup, "device"), H.DEVICE_HOMED.per_elem(setup, "host")) == (
        12,
        0,
    )
    # the disk saves the master and moments (12 B) on the host in every setup (fp32: the home
    # is the master and goes with it), homeless or not where homeless chunks may be
    assert H.HOST.per_elem(setup, "host") - H.NVME.per_elem(setup, "host") == 12
    if H.HOMELESS.refusal(setup, "during_backward") is None:
        assert H.HOMELESS.per_elem(setup, "host") - H.NVME_HOMELESS.per_elem(setup, "host") == 12
    assert H.NVME.per_elem(setup, "disk") == H.NVME_HOMELESS.per_elem(setup, "disk") == 12


def test_frozen_chunks_keep_their_values_only():
    for setup in (BF16, FP32):
        assert H.PERSISTENT.per_elem(setup, "device", trainable=False) == setup.cb
        assert H.HOST.per_elem(setup, "host", trainable=False) == setup.cb
        assert (
            H.NVME.per_elem(setup, "host", trainable=False) == setup.cb
        )  # (no states to put on disk)
        assert H.DEVICE_HOMED.per_elem(setup, "device", trainable=False) == setup.cb
        assert (
            H.HOMELESS.parts(setup, trainable=False) == []
        )  # needs_trainable: no copy would be left


def test_element_counts_and_disk_alignment():
    # a persistent chunk's values and gradients cover the padded chunk; its states what it owns
    assert H.PERSISTENT.nbytes(BF16, "device", chunk=1000, own=250) == 1000 * (2 + 2) + 250 * (
        4 + 8
    )
    assert H.padded_numel(1001, 4) == 1004 and H.shard_numel(1001, 4) == 251
    assert H.own_numel(1000, 1, end=130) == 192  # up to the last parameter, rounded to VEC_ALIGN
    assert H.own_numel(1000, 1, end=999) == 1000 and H.own_numel(1001, 4, end=5) == 251
    # each disk tensor starts on its own page: three of them for master and moments
    assert H.NVME.nbytes(BF16, "disk", chunk=10, own=10) == 3 * H.NVME_ALIGN
    assert H.HOST.nbytes(BF16, "host", chunk=10, own=10, kind="home") == 20


def test_traffic_and_preconditions():
    assert H.HOMELESS.fetch_host_bytes(BF16) == 4 + 2 and H.HOST.fetch_host_bytes(BF16) == 0
    assert [h.name for h in H.HOMES.values() if h.fetch_reads_disk(BF16)] == ["nvme_homeless"]
    assert [h.name for h in H.HOMES.values() if h.fetch_reads_disk(FP32)] == [
        "nvme",
        "nvme_homeless",
    ]
    assert H.NVME.step_disk_bytes() == (12, 12) and H.HOST.step_disk_bytes() == (0, 0)
    assert H.HOMELESS.refusal(FP32, "during_backward") == "needs 16-bit compute"
    assert "grad_accum 1" in H.DEVICE_HOMED.refusal(BF16_ACC2, "during_backward")
    assert "during_backward" in H.DEVICE_HOMED.refusal(BF16, "after_backward")
    assert all(h.refusal(BF16, "during_backward") is None for h in H.HOMES.values())
    assert [h.name for h in H.HOMES.values() if h.refusal(FP32_ACC2, "after_backward") is None] == [
        "persistent",
        "host",
        "nvme",
    ]


def test_homes_of_names_one_home_per_chunk_and_refuses_what_names_none():
    assert H.homes_of(6, [0], homeless=[4, 5], device_homed=[1], nvme=[3, 5]) == [
        "persistent",
        "device_homed",
        "host",
        "nvme",
        "homeless",
        "nvme_homeless",
    ]
    with pytest.raises(PlanError, match=r"not offloaded - at `\$\.placement\.homeless`"):
        H.homes_of(3, [0], homeless=[0])
    with pytest.raises(PlanError, match="also in `nvme`"):
        H.homes_of(3, [], device_homed=[1], nvme=[1])
    with pytest.raises(PlanError, match="out of range"):
        H.homes_of(3, [3])


def test_policies_hold_what_they_say():
    assert [H.held_bytes(p, saved=100, inputs=7) for p in ("keep", "swap", "checkpoint")] == [
        100,
        0,
        7,
    ]


POLICY_SPELLERS = {
    "plans/homes.py": "the table itself",
    "plans/plan.py": "the schema's Literal (a new policy is a schema version and a migration)",
    "executor/activations.py": "the mechanism: what a block's pack/unpack hooks do under each "
    "policy",
    "planner/search/grid.py": "the search's space: one mask per policy over the strips",
    "planner/search/milp.py": "the search's space as MILP variables, one one-hot per policy",
}
"""The only modules that may spell a block policy's name: the rest read ``homes.POLICIES``
(``held``, ``moves``, ``recomputes``, ``letter``) or its entries' ``.name``."""


def test_policies_are_named_only_by_the_table_mechanism_search_space_and_schema():
    """A fourth policy is one entry in homes.POLICIES plus the modules above: a module that
    tests ``policy == "swap"`` (as emit, validation, memory_walk and memory_plot once did)
    would have to be found and changed by hand."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    names = set(H.POLICIES)
    found = []
    for package in ("executor", "planner"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Constant)
                    and node.value in names
                    and rel not in POLICY_SPELLERS
                    and not (rel == "planner/commands/cli_train.py" and node.value == "checkpoint")
                ):
                    found.append(
                        f"{rel}:{node.lineno}: {node.value!r}"
                    )  # (cli: --resume's dest, a checkpoint)
    assert not found, "read homes.POLICIES instead of spelling a policy:\n" + "\n".join(found)
