"""Scope configuration (``from nvalchemi.distributed.config import DomainConfig``)."""

from nvdd.dynamics import DomainConfig, HookScope
from nvdd.spec import StrategyKind

__all__ = ["DomainConfig", "HookScope", "StrategyKind"]
