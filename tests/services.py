"""Moved to :mod:`tests.support.services`; kept importable for code written before the move."""

from tests.support.services import *  # noqa: F403
from tests.support.services import (  # noqa: F401
    BROKERS,
    IN_CI,
    ROOT,
    RedisServer,
    Workers,
    free_port,
    kill_group,
    private_redis_settings,
    require_program,
    require_service,
    reset_broker_pools,
    service_reachable,
    stop_processes,
    unavailable,
    wait_until,
    worker_env,
)
