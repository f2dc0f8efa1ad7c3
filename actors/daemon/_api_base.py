"""What the daemon API's parts share: the services they stand on (see `api`)."""

from __future__ import annotations

from stepd.actors import ActorSystem, Clock
from stepd.storage import Storage

from . import audit as _audit
from .catalog import Catalog
from .services import DaemonConfig, DaemonStats, Services

__all__ = ["ApiBase"]


class ApiBase:
    """The daemon API's state: nothing but the ground its actors stand on."""

    services: Services
    storage: Storage
    catalog: Catalog
    config: DaemonConfig
    clock: Clock
    system: ActorSystem
    stats: DaemonStats
    audit: _audit.AuditLog

    def __init__(self, services: Services) -> None:
        self.services = services
        self.storage = services.storage
        self.catalog = services.catalog
        self.config = services.config
        self.clock = services.clock
        self.system = services.system
        self.stats = services.stats
        #: The audit log (its entries are written in the operations' transactions).
        self.audit = _audit.AuditLog(services.storage)
