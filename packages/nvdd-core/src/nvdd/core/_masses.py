"""Standard atomic masses (IUPAC conventional values, in atomic mass units).

Index ``Z`` holds the mass of element ``Z``; index 0 is a placeholder (1.0) used
for dummy atoms.
"""

from __future__ import annotations

import torch

from nvdd.core._errors import ValidationError

__all__ = ["ATOMIC_MASSES", "masses_for"]

#: Standard atomic masses (amu) by atomic number ``Z``; index 0 (1.0) is for dummy atoms.
ATOMIC_MASSES: tuple[float, ...] = (
    1.0,
    1.008,
    4.002602,
    6.94,
    9.012183,
    10.81,
    12.011,
    14.007,
    15.999,
    18.998403,
    20.1797,
    22.989769,
    24.305,
    26.981538,
    28.085,
    30.973762,
    32.06,
    35.45,
    39.948,
    39.0983,
    40.078,
    44.955908,
    47.867,
    50.9415,
    51.9961,
    54.938044,
    55.845,
    58.933194,
    58.6934,
    63.546,
    65.38,
    69.723,
    72.63,
    74.921595,
    78.971,
    79.904,
    83.798,
    85.4678,
    87.62,
    88.90584,
    91.224,
    92.90637,
    95.95,
    97.90721,
    101.07,
    102.9055,
    106.42,
    107.8682,
    112.414,
    114.818,
    118.71,
    121.76,
    127.6,
    126.90447,
    131.293,
    132.905452,
    137.327,
    138.90547,
    140.116,
    140.90766,
    144.242,
    144.91276,
    150.36,
    151.964,
    157.25,
    158.92535,
    162.5,
    164.93033,
    167.259,
    168.93422,
    173.054,
    174.9668,
    178.49,
    180.94788,
    183.84,
    186.207,
    190.23,
    192.217,
    195.084,
    196.966569,
    200.592,
    204.38,
    207.2,
    208.9804,
    208.98243,
    209.98715,
    222.01758,
    223.01974,
    226.02541,
    227.02775,
    232.0377,
    231.03588,
    238.02891,
    237.04817,
    244.06421,
    243.06138,
    247.07035,
    247.07031,
    251.07959,
    252.083,
    257.09511,
    258.09843,
    259.101,
    262.11,
    267.122,
    268.126,
    271.134,
    270.133,
    269.1338,
    278.156,
    281.165,
    281.166,
    285.177,
    286.182,
    289.19,
    289.194,
    293.204,
    293.208,
    294.214,
)


def masses_for(atomic_numbers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Standard masses for ``atomic_numbers``, shape ``(n_atoms,)``, in ``dtype``.

    Raises
    ------
    ValidationError
        If an atomic number is outside ``[0, 118]``.
    """
    if atomic_numbers.numel() > 0:
        lo, hi = int(atomic_numbers.min()), int(atomic_numbers.max())
        if lo < 0 or hi >= len(ATOMIC_MASSES):
            bad = lo if lo < 0 else hi
            raise ValidationError(
                f"atomic number {bad} has no standard mass (valid: 0..{len(ATOMIC_MASSES) - 1})"
            )
    table = torch.tensor(ATOMIC_MASSES, dtype=dtype, device=atomic_numbers.device)
    return table[atomic_numbers.long()]
