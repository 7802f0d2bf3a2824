"""MACEModel: mace-torch's own calculator as the oracle, and N gloo ranks vs one process.

The DD runs follow the runtime contract with nvdd-halo directly
(``models_ddcases.py``), with the spec's adapters installed as the runtime
installs them.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models_ddcases import CASES, count_exchanges, global_batch, make_model, run_steps
from models_testutils import ghost_layout, jittered_lattice, make_batch, saved_bytes

from nvdd.core import Batch, ConfigurationError, ValidationError
from nvdd.models import MACEConfig, MACEModel, build_mace, load_mace
from nvdd.models._mace_deps import cueq_available, mace_module
from nvdd.shardtensor import DDContext, SelfImageLayout, dd_scope
from nvdd.spec import SPEC_MPNN_HALO, AdapterRegistry, MethodAdapter, StrategyKind
from nvdd.testing import assert_close_by_id, assert_same_ids, importorskip_extra, run_ranks

importorskip_extra("mace")  # a failure, not a skip, where CI installs the extras
# e3nn scripts its generated code when a MACE is built or compiled in a test.
pytestmark = pytest.mark.filterwarnings("ignore:The TorchScript type system:UserWarning")

ATOL = 1e-10
ZS = (8, 14)


def _sio2_like(dtype: torch.dtype = torch.float64, pbc: tuple[bool, ...] = (True,) * 3) -> Batch:
    """40 atoms (1/3 O, 2/3 Si, shuffled) on a jittered lattice in a triclinic cell."""
    cell = np.array([[7.0, 0.0, 0.0], [0.9, 6.5, 0.0], [-0.6, 0.7, 6.8]])
    pos = jittered_lattice((4, 2, 5), cell, 0.2, seed=3)
    z = np.random.default_rng(3).choice(ZS, size=len(pos)).tolist()
    return make_batch(pos, cell, pbc, z, dtype=dtype)


def _mace(dtype: torch.dtype = torch.float64, **kw: Any) -> torch.nn.Module:
    return build_mace(MACEConfig(atomic_numbers=ZS, r_max=3.5, **kw), dtype=dtype)


def _calculator_outputs(mace: torch.nn.Module, batch: Batch) -> dict[str, np.ndarray]:
    """Energy, forces and stress from mace-torch's ASE calculator (its own graph)."""
    calculators = mace_module("mace.calculators")
    dtype = "float64" if batch.dtype == torch.float64 else "float32"
    calc = calculators.MACECalculator(models=mace, device="cpu", default_dtype=dtype)
    (atoms,) = batch.to_ase()
    atoms.calc = calc
    return {
        "energy": np.array([atoms.get_potential_energy()]),
        "forces": atoms.get_forces(),
        "stress": atoms.get_stress(voigt=False)[None],
    }


@pytest.fixture(autouse=True)
def _keep_torch_load_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # mace.calculators sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD on import; undo it after the test.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0")


# ------------------------------------------------------------- one process
@pytest.mark.parametrize("pbc", [(True, True, True), (True, False, True), (False, False, False)])
def test_mace_equals_mace_torch_s_own_calculator(pbc: tuple[bool, bool, bool]) -> None:
    """Edge direction, image shifts, species order and stress sign, against mace-torch."""
    mace = _mace()
    batch = _sio2_like(pbc=pbc)
    out = MACEModel(mace)(batch)
    ref = _calculator_outputs(mace, batch)
    np.testing.assert_allclose(out["energy"].numpy(), ref["energy"], rtol=0, atol=1e-10)
    np.testing.assert_allclose(out["forces"].numpy(), ref["forces"], rtol=0, atol=ATOL)
    if all(pbc):
        np.testing.assert_allclose(out["stress"].numpy(), ref["stress"], rtol=0, atol=ATOL)
    assert float(np.abs(ref["forces"]).max()) > 1e-3  # not a trivially zero model


def test_float32_model_agrees_with_float64() -> None:
    batch = _sio2_like()
    ref = MACEModel(_mace())(batch)
    out = MACEModel(_mace(), dtype=torch.float32)(batch.to(dtype=torch.float32))
    assert out["forces"].dtype == torch.float32 and out["energy"].dtype == torch.float32
    scale = float(ref["forces"].abs().max())
    torch.testing.assert_close(out["forces"].double(), ref["forces"], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(out["energy"].double(), ref["energy"], rtol=1e-6, atol=0)


def test_plain_mace_class_and_species_order() -> None:
    """A ``MACE`` (not ScaleShift) built with the elements in the other order."""
    modules, o3 = mace_module("mace.modules"), mace_module("e3nn.o3")
    torch.manual_seed(1)
    plain = modules.MACE(
        r_max=3.5,
        num_bessel=6,
        num_polynomial_cutoff=5,
        max_ell=2,
        interaction_cls=modules.interaction_classes["RealAgnosticInteractionBlock"],
        interaction_cls_first=modules.interaction_classes["RealAgnosticInteractionBlock"],
        num_interactions=2,
        num_elements=2,
        hidden_irreps=o3.Irreps("8x0e+8x1o"),
        MLP_irreps=o3.Irreps("8x0e"),
        gate=torch.nn.functional.silu,
        atomic_energies=np.array([-3.0, -5.0]),
        avg_num_neighbors=8.0,
        atomic_numbers=[14, 8],
        correlation=2,
    ).double()
    batch = _sio2_like()
    model = MACEModel(plain)
    assert model.atomic_numbers == [14, 8]
    out = model(batch)
    ref = _calculator_outputs(plain, batch)
    np.testing.assert_allclose(out["forces"].numpy(), ref["forces"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(out["energy"].numpy(), ref["energy"], rtol=0, atol=1e-10)
    e0 = torch.where(batch.atomic_numbers == 14, -3.0, -5.0).sum()
    assert abs(float(out["energy"][0] - e0)) > 1e-3  # the interactions contribute


def test_saved_model_file_round_trip(tmp_path: Path) -> None:
    mace = _mace()
    path = tmp_path / "small.model"
    torch.save(mace, path)
    batch = _sio2_like()
    ref = MACEModel(mace)(batch)
    for loaded in (MACEModel.from_file(path), MACEModel(load_mace(str(path)))):
        out = loaded(batch)
        assert torch.equal(out["forces"], ref["forces"])
        assert torch.equal(out["energy"], ref["energy"])
    with pytest.raises(ConfigurationError, match=r"MACE model file .*missing.model.* does not"):
        load_mace(tmp_path / "missing.model")


def test_frozen_weights_keep_less_for_the_backward_and_change_no_force() -> None:
    """The wrapper freezes MACE's parameters by default (as mace-torch's torch-sim
    model does): the forces differentiate the positions only, so autograd saves no
    activation only a weight gradient needs (record 0089), and the energies, forces,
    per-atom energies and stress are the same bit for bit (float64). freeze=False
    leaves the parameters as given."""
    mace = _mace()
    assert all(p.requires_grad for p in mace.parameters())  # (as build_mace made them)
    kept = MACEModel(mace, freeze=False)
    assert all(p.requires_grad for p in kept.parameters())
    frozen = MACEModel(copy.deepcopy(mace))
    assert not any(p.requires_grad for p in frozen.parameters())
    batch = _sio2_like()
    # (the process's first MACE call may differ in the last bit from later ones: e3nn's
    # TorchScript code runs unoptimised once; a call of each first)
    frozen(batch), kept(batch)
    small, got = saved_bytes(lambda: frozen(batch))
    large, ref = saved_bytes(lambda: kept(batch))
    assert 0 < small < 0.85 * large, (small, large)  # (0.74 here)
    for key in ("energy", "forces", "atom_energies", "stress"):
        assert torch.equal(got[key], ref[key]), key
    assert all(p.grad is None for p in kept.parameters())


def test_importing_the_wrapper_leaves_torch_load_s_default_alone() -> None:
    """mace-torch sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 on import; the wrapper restores it."""
    code = (
        "import os\n"
        "from nvdd.models import MACEConfig, build_mace\n"
        "build_mace(MACEConfig())\n"
        "import mace, e3nn\n"
        "print(repr(os.environ.get('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "None"


def test_bad_inputs_are_named() -> None:
    model = MACEModel(_mace())
    batch = _sio2_like()
    z = batch.atomic_numbers.clone()
    z[3] = 6
    with pytest.raises(ValidationError, match=r"atomic_numbers\[3\] = 6 has no parameters"):
        model(batch.replace(atomic_numbers=z))
    with pytest.raises(ValidationError, match=r"batch is torch.float32 but the MACE parameters"):
        model(batch.to(dtype=torch.float32))
    with pytest.raises(ConfigurationError, match="wraps a mace-torch MACE"):
        MACEModel(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="head 'pbe' is not one of"):
        MACEModel(_mace(), head="pbe")
    with pytest.raises(ConfigurationError, match="dtype must be"):
        MACEModel(_mace(), dtype=torch.float16)
    # graph partition is supported (test_models_mace_gp.py); not a strategy is not
    assert (
        model.distribution_spec(StrategyKind.GRAPH_PARTITION).strategy
        is StrategyKind.GRAPH_PARTITION
    )
    with pytest.raises(ConfigurationError, match="strategy must be a StrategyKind, got 'spatial'"):
        model.distribution_spec("spatial")


def test_spec_refreshes_before_every_interaction_after_the_first() -> None:
    model = MACEModel(_mace(num_interactions=3))
    spec = model.distribution_spec()
    assert spec is model.distribution_spec("halo") and spec.name == "SPEC_MACE_HALO"
    assert spec.outputs == SPEC_MPNN_HALO.outputs
    assert spec.force_strategy is SPEC_MPNN_HALO.force_strategy
    # interactions 1 and 2 share a class, the three products another: two patches
    refresh, product = spec.adapters()
    assert isinstance(refresh, MethodAdapter) and isinstance(product, MethodAdapter)
    assert refresh.method == "mace.modules.blocks:RealAgnosticResidualInteractionBlock.forward"
    assert product.method == "mace.modules.blocks:EquivariantProductBasisBlock.forward"
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_scripted_mace_runs_on_one_process_but_refuses_dd() -> None:
    mace = _mace()
    jit = mace_module("e3nn.util.jit")
    scripted = jit.compile(mace)
    assert isinstance(scripted, torch.jit.ScriptModule)
    batch = _sio2_like()
    ref = MACEModel(mace)(batch)
    model = MACEModel(scripted)
    assert not any(p.requires_grad for p in model.parameters())  # (frozen, as a Python MACE)
    out = model(batch)
    torch.testing.assert_close(out["forces"], ref["forces"], rtol=0, atol=ATOL)
    for strategy in StrategyKind:
        with pytest.raises(ConfigurationError, match="TorchScript-compiled MACE cannot run under"):
            model.distribution_spec(strategy)


@pytest.mark.gpu
@pytest.mark.skipif(not cueq_available(), reason="cuequivariance-torch is not installed")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuequivariance_kernels_equal_e3nn(dtype: torch.dtype) -> None:
    batch = _sio2_like(dtype=dtype).to("cuda")
    e3nn = MACEModel(_mace(dtype), device="cuda", cueq=False)
    cueq = MACEModel(_mace(dtype), device="cuda", cueq=True)
    assert cueq.uses_cueq and not e3nn.uses_cueq
    assert not any(p.requires_grad for p in cueq.parameters())  # (frozen after the conversion)
    a, b = e3nn(batch), cueq(batch)
    scale = float(a["forces"].abs().max())
    tol = 1e-10 if dtype == torch.float64 else 1e-5 * scale
    torch.testing.assert_close(b["forces"], a["forces"], rtol=0, atol=tol)
    torch.testing.assert_close(b["energy"], a["energy"], rtol=1e-6, atol=tol)


@pytest.mark.parametrize(
    ("device", "cueq"),
    [
        ("cpu", False),
        pytest.param(
            "cuda",
            True,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not cueq_available(), reason="cuequivariance is not installed"),
            ],
        ),
    ],
    ids=["e3nn-cpu", "cueq-cuda"],
)
def test_on_its_own_periodic_images_equals_the_periodic_model(device: str, cueq: bool) -> None:
    """A decomposed rank without a process group: every atom owned, the ghosts its
    own periodic images, refreshed by the spec's adapters before each interaction.
    Summed into their source atoms, the forces (and the energy and stress) equal
    the e3nn model on the periodic cell: on CUDA with cuEquivariance's kernels,
    whose modules the adapters must reach the same way."""
    full = _sio2_like()
    reference = MACEModel(_mace())(full)
    model = MACEModel(_mace(), device=device, cueq=cueq)
    assert model.uses_cueq is cueq
    layout = ghost_layout(full, torch.arange(full.n_atoms), model.cutoff)
    assert layout.batch.n_atoms > layout.n_owned  # ghosts exist
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :].to(device))
    batch = layout.batch.to(device)
    leaf = batch.positions.clone().requires_grad_(True)
    adapters = model.distribution_spec().adapters()
    # the product blocks run on the owned rows only and hand zeros to the ghosts
    rows_in: list[int] = []
    ghost_out: list[float] = []
    hooks = []
    for product in model.mace.products:
        hooks.append(
            product.symmetric_contractions.register_forward_pre_hook(
                lambda _m, args: rows_in.append(int(args[0].shape[0]))
            )
        )
        hooks.append(
            product.register_forward_hook(
                lambda _m, _a, out: ghost_out.append(
                    float(out.detach()[layout.n_owned :].abs().max())
                )
            )
        )
    with AdapterRegistry(adapters), dd_scope(DDContext(layout=halo, positions=leaf)):
        out = {k: v.detach().cpu() for k, v in model(batch.replace(positions=leaf)).items()}
    for hook in hooks:
        hook.remove()
    assert rows_in == [layout.n_owned] * len(model.mace.products), rows_in
    assert ghost_out == [0.0] * len(model.mace.products), ghost_out
    forces = torch.zeros_like(reference["forces"]).index_add(0, layout.source, out["forces"])
    torch.testing.assert_close(out["energy"], reference["energy"], rtol=0, atol=ATOL)
    torch.testing.assert_close(forces, reference["forces"], rtol=0, atol=ATOL)
    torch.testing.assert_close(out["stress"], reference["stress"], rtol=0, atol=ATOL)


# ------------------------------------------------------- gloo: N ranks vs 1
def _oracle(case: str, layers: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    batch = global_batch(case, "mace", dtype=dtype)
    out = dict(make_model("mace", layers, dtype=dtype)(batch))
    out["ids"] = batch.atom_ids
    return out


# periodic-2 runs in float32 in test_models_mace_more.py
MACE_CASES = [
    ("triclinic-3", 3),
    ("mixed-open-cuts-3", 2),
    ("two-systems-2", 2),
    ("open-lopsided-2", 2),  # a rank without ghost rows still refreshes
]


def _world_rank(case: str, layers: int) -> dict[str, Any]:
    """Rank body of one world of :data:`MACE_CASES`: the case's run; on
    ``triclinic-3`` also the same case without the spec's adapters (2
    interactions), on ``two-systems-2`` also the exchanges of a 3-interaction
    forward on ``periodic-2`` (the world is shared by three tests)."""
    out: dict[str, Any] = {"run": run_steps("mace", case, layers=layers)[0]}
    if case == "triclinic-3":
        out["no_refresh"] = run_steps("mace", case, mode="no-refresh")[0]
    if case == "two-systems-2":
        out["exchanges"] = count_exchanges("mace", "periodic-2", 3)
    return out


@functools.cache
def _world(case: str, layers: int) -> list[dict[str, Any]]:
    """Every rank's :func:`_world_rank` (cached: tests below read the same world)."""
    return run_ranks(_world_rank, CASES[case][0], case, layers, timeout_s=300)


@pytest.mark.gloo
@pytest.mark.parametrize(("case", "layers"), MACE_CASES, ids=[f"{c}-L{n}" for c, n in MACE_CASES])
def test_mace_ranks_equal_the_single_process_model_by_id(case: str, layers: int) -> None:
    got = [r["run"] for r in _world(case, layers)]
    ref = _oracle(case, layers)
    ids = torch.cat([g["ids"] for g in got])
    assert_same_ids(ids, ref["ids"])
    for key in ("forces", "atom_energies"):
        values = torch.cat([g[key] for g in got])
        assert_close_by_id(ids, values, ref["ids"], ref[key], atol=ATOL, what=key)
    for g in got:
        for key in ("energy", "virial", "stress"):
            torch.testing.assert_close(g[key], ref[key], rtol=0, atol=ATOL, msg=key)
    ghosts = [g["n_ghost"] for g in got]
    # (the lopsided case has one rank without ghost rows by design)
    assert all(ghosts) if case != "open-lopsided-2" else ghosts.count(0) == 1, ghosts


@pytest.mark.gloo
def test_without_the_refresh_the_forces_are_wrong() -> None:
    """The same run with the spec's adapters left out: stale ghost features show."""
    case = "triclinic-3"
    got = [r["no_refresh"] for r in _world(case, 3)]  # the triclinic-3-L3 case's world
    ref = _oracle(case, 2)
    ids, forces = torch.cat([g["ids"] for g in got]), torch.cat([g["forces"] for g in got])
    with pytest.raises(AssertionError, match="forces differ"):
        assert_close_by_id(ids, forces, ref["ids"], ref["forces"], atol=1e-6, what="forces")


@pytest.mark.gloo
def test_two_exchanges_per_interaction_after_the_first() -> None:
    """Refresh forward + its reverse in the backward, none for the first interaction:
    4 for 3 interactions (6 if the first were refreshed too)."""
    counts = [r["exchanges"] for r in _world("two-systems-2", 2)]  # periodic-2, 3 interactions
    assert counts == [4, 4]


def test_every_tensor_of_the_wrapper_follows_device() -> None:
    """MACEModel(..., device=d) puts its own buffers (species rows) on d too: a CPU
    buffer next to CUDA atoms broke the first H200 run (meta stands in for CUDA)."""
    model = MACEModel(_mace(), device="meta")
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    assert devices == {"meta"}


def test_cueq_without_its_dependencies_says_what_failed_to_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuequivariance installed but broken (its own dependency missing): the error
    carries the install hint and the import's own message."""
    import importlib

    from nvdd.core import OptionalDependencyError
    from nvdd.models import _mace_deps
    from nvdd.models._mace import _to_cueq

    real = importlib.import_module

    def failing(name: str, package: str | None = None) -> Any:
        if name.startswith("cuequivariance"):
            raise ModuleNotFoundError("No module named 'platformdirs'", name="platformdirs")
        return real(name, package)

    monkeypatch.setattr(_mace_deps.importlib, "import_module", failing)
    with pytest.raises(OptionalDependencyError) as info:
        _to_cueq(torch.nn.Linear(1, 1), torch.device("cpu"))  # what MACEModel(cueq=True) calls
    message = str(info.value)
    assert message.startswith("MACEModel(cueq=True) needs cuequivariance-torch")
    assert "pip install cuequivariance-torch" in message
    assert "(the import failed with ModuleNotFoundError: No module named 'platformdirs')" in message


def test_importing_mace_prints_no_cueq_notice_unless_verbose(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """mace-torch 0.3 prints this line at import in every process when
    cuEquivariance does not import; nvdd's import of the stack keeps it back
    (other output stays) unless NVDD_VERBOSE=1."""
    from nvdd.models import _mace_deps

    notice = (
        "cuequivariance or cuequivariance_torch is not available. Cuequivariance "
        "acceleration will be disabled."
    )
    monkeypatch.delenv("NVDD_VERBOSE", raising=False)
    with _mace_deps._without_cueq_notice():
        print(notice)
        print("another line")
    assert capsys.readouterr().out == "another line\n"
    monkeypatch.setenv("NVDD_VERBOSE", "1")
    with _mace_deps._without_cueq_notice():
        print(notice)
    assert capsys.readouterr().out == notice + "\n"
