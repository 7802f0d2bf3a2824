"""The field lists of a Batch agree: the constants, the BatchFields protocol, the
keyword arguments of Batch, the fields Batch.from_ase fills, and a real batch.

They are written out several times by construction (a Protocol and a TypedDict
must list their names); this test stops one of them drifting from the others.
"""

from __future__ import annotations

import inspect
import typing

import torch

from nvdd.core import Batch
from nvdd.core._ase import AseFields
from nvdd.core._fields import PER_ATOM_FIELDS, PER_SYSTEM_FIELDS, BatchFields

CORE = set(PER_ATOM_FIELDS) | set(PER_SYSTEM_FIELDS)
EXTRAS = {"atom_extras", "system_extras"}


def _protocol_attrs() -> set[str]:
    hints = typing.get_type_hints(BatchFields, localns={"torch": torch})
    return set(hints)


def test_the_protocol_lists_every_core_field_and_the_extras() -> None:
    assert _protocol_attrs() == CORE | EXTRAS
    props = {n for n, v in vars(BatchFields).items() if isinstance(v, property)}
    assert props == {"n_atoms", "n_systems"}


def test_batch_takes_every_core_field_and_the_extras_as_arguments() -> None:
    params = set(inspect.signature(Batch.__init__).parameters) - {"self", "validate"}
    assert params == CORE | EXTRAS


def test_from_ase_fills_every_core_field() -> None:
    assert set(typing.get_type_hints(AseFields, localns={"torch": torch})) == CORE


def test_a_batch_has_every_protocol_field_with_the_documented_leading_shape() -> None:
    b = Batch(torch.zeros(3, 3, dtype=torch.float64), torch.tensor([18, 18, 1]))
    for name in PER_ATOM_FIELDS:
        assert getattr(b, name).shape[0] == b.n_atoms, name
    for name in PER_SYSTEM_FIELDS:
        assert getattr(b, name).shape[0] == b.n_systems, name
    for name in EXTRAS:
        assert isinstance(getattr(b, name), dict), name
    checked: BatchFields = b  # mypy: a Batch satisfies the protocol
    assert checked.n_atoms == 3
