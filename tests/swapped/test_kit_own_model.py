"""The testing kit on a project's own order model (the example in docs/testing.md)."""

import pytest

from tests.shop.models import Phase
from tests.support.messages import payment, shipment


@pytest.mark.django_db(transaction=True)  # as in production: each delivery commits
def test_every_message_applies_once(exactly_once, make_order) -> None:
    orders = [make_order() for _ in range(5)]
    messages = [("payments", payment(o, seq=1)) for o in orders]
    messages += [("shipping", shipment(o, seq=2)) for o in orders]
    # Every e-mail and every call of the gateway, counted per business event.
    with exactly_once.watch_effects("mail", "tests.support.gateway.capture") as effects:
        with pytest.raises(exactly_once.WorkerDied), exactly_once.crash_at("after_order_update"):
            exactly_once.deliver(messages[:1])  # the worker dies before its commit
        storm = exactly_once.shuffled_copies(messages, copies=(1, 4))
        exactly_once.deliver(storm[::2])
        exactly_once.deliver_in_batches(storm[1::2])
        exactly_once.assert_exactly_once(
            orders, messages, states={o.pk: Phase.SENT for o in orders}
        )
    assert not effects.count("mail")  # this shop sends none
