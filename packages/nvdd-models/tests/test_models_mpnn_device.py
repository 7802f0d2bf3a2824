"""ReferenceMPNN on its device edges (``MPNNConfig.neighbors="device"``).

The edges against a brute-force search, the outputs against the Verlet path,
the fixed capacities' overflow (grown at once outside a capture, reported by
the verdict of a captured step), the choice of path, copies and bad input.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from models_testutils import DEVICES, brute_edges_batch, edge_set
from test_models_mpnn import _CFG as _MPNN_CFG
from test_models_mpnn import _batch as _mpnn_batch

from nvdd.core import Batch, ConfigurationError, EmulatedStepGraph, ValidationError
from nvdd.models import MPNNConfig, ReferenceMPNN

_CFG: dict[str, Any] = {**_MPNN_CFG.__dict__, "skin": 0.3}
_KEYS = ("energy", "forces", "atom_energies", "virial", "stress")


def _batch(kind: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Batch:
    if kind == "two systems":
        first, second = _mpnn_batch("periodic", seed, dtype), _mpnn_batch("mixed", seed, dtype)
        second = second.replace(atom_ids=second.atom_ids + first.n_atoms)
        return Batch.concatenate([first, second])
    return _mpnn_batch(kind, seed, dtype)


def _model(neighbors: str, dtype: torch.dtype = torch.float64, **kw: Any) -> ReferenceMPNN:
    return ReferenceMPNN(MPNNConfig(**{**_CFG, **kw, "neighbors": neighbors}), dtype=dtype)


_KINDS = ["periodic", "mixed", "open", "two systems"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", _KINDS)
def test_device_edges_are_the_brute_force_edges(kind: str, dtype: torch.dtype, device: str) -> None:
    b = _batch(kind, seed=1, dtype=dtype)
    model = _model("device", dtype).to(device)
    edges = model.device_edges(
        *(t.to(device) for t in (b.positions, b.cell, b.pbc, b.system_index))
    )
    real = edges.compact()
    assert edges.n_edges == model.device_edges.capacity >= real.n_edges > 0
    cpu = type(real)(*(t.cpu() for t in (real.receivers, real.senders, real.shifts)), real.periodic)
    assert edge_set(cpu) == brute_edges_batch(b.to(dtype=torch.float64), _CFG["cutoff"])
    # receivers ascend (row-major), padded edges are (0, 0) without a shift
    assert bool((real.receivers.diff() >= 0).all())
    pad = ~edges.mask
    assert not bool(
        edges.receivers[pad].any() or edges.senders[pad].any() or edges.shifts[pad].any()
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", _KINDS)
def test_the_device_path_equals_the_verlet_path(kind: str, dtype: torch.dtype, device: str) -> None:
    b = _batch(kind, seed=2, dtype=dtype).to(device)
    want = _model("verlet", dtype).to(device)(b)
    got = _model("device", dtype).to(device)(b)
    for key in _KEYS:
        scale = float(want[key].abs().max())
        tol = 1e-12 if dtype == torch.float64 else 1e-5 * max(scale, 1.0)
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=tol, msg=key)
    assert float(want["forces"].abs().max()) > 1e-2


def _denser(b: Batch, factor: float = 0.8) -> Batch:
    """The same atoms in a smaller cell: more edges than a list sized for ``b``."""
    return b.replace(positions=b.positions * factor, cell=b.cell * factor)


def test_edges_that_outgrow_their_capacity_grow_at_once_and_stay_exact() -> None:
    b = _batch("periodic", seed=3)
    model = _model("device")
    model(b)
    before = model.device_edges.capacity
    dense = _denser(b)
    got = model(dense)
    assert model.device_edges.regrows == 1 and model.device_edges.capacity > before
    want = _model("verlet")(dense)
    for key in _KEYS:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=key)


def test_a_captured_overflow_is_reported_by_the_verdict_and_the_next_call_is_exact() -> None:
    b = _batch("periodic", seed=4)
    model = _model("device")
    model(b)
    graph = EmulatedStepGraph()
    graph.capture(lambda: model.begin_step(b))  # a steady step: no host read, it fits
    assert model.take_verdict(b)
    dense = _denser(b)
    graph = EmulatedStepGraph()
    graph.capture(lambda: model.begin_step(dense))
    assert not model.take_verdict(dense)  # the edges did not fit: the step must run eagerly
    got = model(dense)
    want = _model("verlet")(dense)
    torch.testing.assert_close(got["forces"], want["forces"], rtol=0, atol=1e-12)
    assert model.take_verdict(dense)  # (the eager call grew what overflowed)


def test_the_edges_of_begin_step_are_used_by_the_next_call_only() -> None:
    b = _batch("mixed", seed=5)
    model = _model("device")
    model(b)
    calls = model.device_edges.candidates.host_rebuilds
    model.begin_step(b)
    assert model._pending is not None
    first = model(b)
    assert model._pending is None
    torch.testing.assert_close(model(b)["forces"], first["forces"], rtol=0, atol=0)
    assert model.device_edges.candidates.host_rebuilds == calls


def test_which_path_a_call_takes() -> None:
    b = _batch("open")
    assert not _model("auto")._device_path(b)  # auto: the device path on CUDA only
    assert not _model("verlet")._device_path(b)
    assert _model("device")._device_path(b)
    assert not _model("device", skin=0.0).graph_key(b)  # nothing sized yet: not capturable
    model = _model("device")
    model(b)
    assert model.graph_key(b) is not None and model.splits_step
    assert _model("verlet").graph_key(b) is None
    # an explicit receiver bound (a DD seam without a context) takes the Verlet path
    out = model(b, n_receivers=5)
    assert out["forces"].shape == b.positions.shape


def test_a_bad_neighbors_mode_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"neighbors must be one of .*'gpu'"):
        MPNNConfig(neighbors="gpu")


def test_a_copy_of_a_model_searches_afresh_and_agrees() -> None:
    b = _batch("periodic", seed=6)
    model = _model("device")
    want = model(b)
    model.device_edges.headroom = 1.5
    twin = copy.deepcopy(model)
    assert twin.device_edges.capacity == 0 and twin.device_edges.headroom == 1.5
    torch.testing.assert_close(twin(b)["forces"], want["forces"], rtol=0, atol=0)


def test_non_finite_positions_raise_on_the_device_path() -> None:
    b = _batch("periodic", seed=7)
    model = _model("device")
    model(b)
    bad = b.positions.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValidationError, match="NaN or infinite"):
        model(b.replace(positions=bad))  # (replace does not validate by default)


def test_a_deferred_search_error_gives_nan_outputs_and_a_message() -> None:
    """Under DD a rank must not raise alone: the error is recorded and every
    output is NaN, which the runtime's shared finite check turns into a raise
    on every rank (integration_tests/test_it_mpnn_graphs.py)."""
    b = _batch("periodic", seed=8)
    edges = _model("device").device_edges
    edges(b.positions, b.cell, b.pbc, b.system_index)
    assert float(edges.poison(torch.float64)) == 0.0
    bad = b.positions.clone()
    bad[2, 0] = float("inf")
    edges.defer_errors = True
    edges(bad, b.cell, b.pbc, b.system_index)  # no raise
    assert edges.pending_error is not None and "NaN or infinite" in edges.pending_error
    assert bool(torch.isnan(edges.poison(torch.float32)).all())
