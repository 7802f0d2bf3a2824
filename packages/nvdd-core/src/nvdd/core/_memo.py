"""Where :class:`~nvdd.core.TensorMemo` lived until it moved beside `Batch`
(``nvdd.core._batch``, record 0083): kept so that objects pickled before the
move (a model holding memos, in a checkpoint or a spawned rank's arguments)
still load. Nothing imports it.
"""

from __future__ import annotations

from nvdd.core._batch import TensorMemo

__all__ = ["TensorMemo"]
