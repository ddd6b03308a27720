"""Demo models: a loyalty account, the kind of state-less counter ``@idempotent`` protects."""

from __future__ import annotations

from django.db import models


class LoyaltyAccount(models.Model):
    """Points per customer; awarding points twice for one message would be a bug."""

    customer = models.CharField(max_length=64, unique=True)
    points = models.IntegerField(default=0)
    #: Fencing token of the last locked write (see ``idempotent_orders.locks``).
    fence = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.customer}: {self.points} points"
