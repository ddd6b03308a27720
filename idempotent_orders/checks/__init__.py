"""System checks with stable IDs (``idempotent_orders.E0xx`` / ``W0xx``), one module per area.

- :mod:`~idempotent_orders.checks.configuration`: ``IDEMPOTENT_ORDERS`` itself
  (names, types, values: E001-E003, E035-E037, W030, W037);
- :mod:`~idempotent_orders.checks.fsm_package`: which package provides the module
  ``django_fsm``: django-fsm-2 or the original django-fsm, or both over each other
  (E004, W004);
- :mod:`~idempotent_orders.checks.order_model`: the order model (E040-E045,
  W041, E052) and its admin's operator transitions (W046);
- :mod:`~idempotent_orders.checks.delivery`: applied once however a message
  arrives (caches, broker, Celery, webhooks, the database and MySQL isolation: E010,
  E012, E030-E034, W031, W032, W034, E050, E051, W051, E080);
- :mod:`~idempotent_orders.checks.http`: the ``Idempotency-Key`` settings
  (E021-E024, W020);
- :mod:`~idempotent_orders.checks.metrics`: who may read ``/metrics``, and the
  multiprocess directory (E090-E092, W090);
- :mod:`~idempotent_orders.checks.partitioning`: the inbox partitioned by time
  (E060, W061-W063);
- :mod:`~idempotent_orders.checks.redis_cluster`: the Redis the fast path and
  the locks run on, when it is a cluster (W010, W011).

Importing this package (the app's ``ready()`` does) imports each module once,
which registers its checks with Django. Every name keeps its import path here.
"""

from __future__ import annotations

from idempotent_orders.checks.configuration import (
    DOTTED_PATH_SETTINGS,
    accepts,
    check_setting_values,
    check_settings,
    setting_type,
)
from idempotent_orders.checks.delivery import (
    DEFAULT_VISIBILITY_TIMEOUT,
    TASK_NAMES,
    VISIBILITY_TRANSPORTS,
    check_celery_tasks,
    check_database_vendor,
    check_dedup,
    check_isolation,
    check_outbox_and_locks,
    check_redis_layer,
    check_retention,
    check_webhooks,
    isolation_errors,
    redelivery_horizon,
)
from idempotent_orders.checks.fsm_package import check_fsm_package, fsm_package_messages
from idempotent_orders.checks.http import check_http_settings
from idempotent_orders.checks.metrics import check_metrics_access
from idempotent_orders.checks.order_model import (
    check_operator_transitions,
    check_order_model,
    check_order_model_history,
    check_payment_timeout,
)
from idempotent_orders.checks.partitioning import check_partitioned_inbox, check_partitions
from idempotent_orders.checks.redis_cluster import check_redis_cluster

__all__ = [
    "DEFAULT_VISIBILITY_TIMEOUT",
    "DOTTED_PATH_SETTINGS",
    "TASK_NAMES",
    "VISIBILITY_TRANSPORTS",
    "accepts",
    "check_celery_tasks",
    "check_database_vendor",
    "check_dedup",
    "check_fsm_package",
    "check_http_settings",
    "check_isolation",
    "check_metrics_access",
    "check_operator_transitions",
    "check_order_model",
    "check_order_model_history",
    "check_outbox_and_locks",
    "check_partitioned_inbox",
    "check_partitions",
    "check_payment_timeout",
    "check_redis_cluster",
    "check_redis_layer",
    "check_retention",
    "check_setting_values",
    "check_settings",
    "check_webhooks",
    "fsm_package_messages",
    "isolation_errors",
    "redelivery_horizon",
    "setting_type",
]
