"""Connecting to Ray: a local instance on loopback, or an existing cluster at ``ray.address``.

``ray`` is imported here and only here on first use, so ``import stalebound`` never loads it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from stalebound._extras import import_extra

if TYPE_CHECKING:
    from stalebound.config import RayConfig

__all__ = ["import_ray", "init_ray"]

_log = logging.getLogger(__name__)

# A local instance stays on the loopback interface and needs no token: without these Ray binds to
# the host's external address (ignoring _node_ip_address) and asks for authentication.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` naming the extra to install."""
    return import_extra("ray", "backend=ray", "ray")


def init_ray(config: RayConfig) -> Any:
    """Connect this process to Ray per ``config`` and return the ``ray`` module.

    Reuses a connection that already exists (tests share one instance per session). With
    ``address`` unset, starts a local instance bound to 127.0.0.1 with ``num_cpus`` and
    ``object_store_memory``; otherwise joins the cluster at ``address`` (``"auto"`` finds the one
    started on this node with ``ray start``).
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    if config.address is None:
        for key, value in _LOOPBACK_ENV.items():
            os.environ.setdefault(key, value)
        ray.init(
            num_cpus=config.num_cpus,
            object_store_memory=config.object_store_memory,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.WARNING,
        )
        _log.info("started a local Ray instance (loopback)")
    else:
        ray.init(address=config.address, logging_level=logging.WARNING)
        _log.info("joined the Ray cluster at %s", config.address)
    return ray
