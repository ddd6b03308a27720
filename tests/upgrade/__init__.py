"""An idempotent_orders 0.1.0 database, upgraded in place (tests/test_upgrade.py)."""
