"""A fixed handful of randomized N-ranks-vs-one cases (``it_fuzz``), in CI.

The seeds were chosen to cover, together, every integrator (velocity Verlet,
Langevin, FIRE, Nose-Hoover NVT, MTK NPT isotropic and full cell), every model
(Lennard-Jones fp64 and fp32, the MPNN with 2 and 3 layers), periodic, slab,
wire and open boundaries (with and without a zero cell vector on an open axis),
cubic, orthorhombic, triclinic and thin cells, 2 to 4 ranks, a zero skin, load
balancing, HALO and GRAPH_PARTITION, hooks of every scope and a checkpoint and
restart in the middle of the run (Nose-Hoover and NPT), and the whole periodic
axes left to the model (``DomainConfig(wrap_whole_axes=True)``, record 0079:
seeds 4, 329, 144, 3241, 4021 and 4027). A longer campaign
(any seeds) is the module's command line (``it_fuzz.py``).
"""

from __future__ import annotations

import pytest
from it_fuzz import check, random_case

pytestmark = pytest.mark.gloo

#: The first eight cover every choice; 3241 found equal quantile cuts (an empty
#: box), 3702 FIRE stepping from a converged structure along force noise; 4021
#: (NVT-NH) and 4027 (NPT, full cell) restart from a checkpoint mid-run.
SEEDS = [4, 654, 482, 329, 144, 42, 139, 15, 3241, 3702, 4021, 4027]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_case_matches_one_process_by_atom_id(seed: int) -> None:
    case = random_case(seed)
    errors, info = check(case)
    assert errors == [], (case, info)
    assert info["n"] > 0 and len(info["n_local"]) == (1 if case.get("one_rank") else case["world"])
