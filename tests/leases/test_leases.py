"""Leases: claim, takeover after expiry, heartbeat and completion fenced by token and attempt."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from idempotent_orders import leases
from idempotent_orders.leases import ClaimState, Lease, LeasedStep, StepResult, Verification
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage

pytestmark = pytest.mark.django_db


def expire(lease: Lease) -> None:
    ProcessedMessage.objects.filter(pk=lease.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


def claim(message_id: str = "m1", token: int = 3, **kwargs) -> leases.ClaimOutcome:
    return leases.claim(consumer="effects", message_id=message_id, token=token, **kwargs)


def test_idempotency_key_is_stable_bounded_and_per_consumer() -> None:
    key = leases.idempotency_key("fulfilment", "fulfil-1")
    assert key == leases.idempotency_key("fulfilment", "fulfil-1")
    assert key != leases.idempotency_key("payments", "fulfil-1")
    assert len(leases.idempotency_key("c", "x" * 255)) == len(key) == 68
    assert "fulfil" not in key


def test_first_claim_wins_and_second_is_busy() -> None:
    first = claim()
    assert first.state is ClaimState.CLAIMED
    assert first.lease is not None
    assert (first.lease.token, first.lease.attempt, first.lease.resumed) == (3, 1, False)
    row = ProcessedMessage.objects.get(pk=first.lease.pk)
    assert row.status == InboxStatus.PROCESSING
    assert row.fencing_token == 3
    assert claim().state is ClaimState.BUSY


def test_expired_lease_is_taken_over_once_and_the_old_holder_is_fenced_out() -> None:
    old = claim().lease
    assert old is not None
    expire(old)
    assert claim(allow_takeover=False).state is ClaimState.BUSY
    new = claim()
    assert new.state is ClaimState.CLAIMED
    assert new.lease is not None
    assert (new.lease.attempt, new.lease.resumed, new.lease.stalls) == (2, True, 1)
    assert claim().state is ClaimState.BUSY  # the new lease is live
    # The dead holder comes back: it can neither extend nor complete.
    assert not leases.heartbeat(old)
    assert not leases.complete(old)
    assert leases.heartbeat(new.lease)
    assert leases.complete(new.lease)
    row = ProcessedMessage.objects.get(pk=new.lease.pk)
    assert (row.status, row.outcome, row.lease_expires_at) == (
        InboxStatus.DONE,
        Outcome.APPLIED,
        None,
    )
    assert claim().state is ClaimState.DONE


def test_completion_rolls_back_when_the_callers_write_fails() -> None:
    lease = claim().lease
    assert lease is not None
    assert not leases.complete(lease, apply=lambda: False)
    assert ProcessedMessage.objects.get(pk=lease.pk).status == InboxStatus.PROCESSING
    assert leases.complete(lease, apply=lambda: True)


def test_release_keeps_the_row_for_a_retry_and_fail_marks_it_failed() -> None:
    lease = claim().lease
    assert lease is not None
    assert leases.release(lease, error="warehouse down")
    row = ProcessedMessage.objects.get(pk=lease.pk)
    assert row.status == InboxStatus.PROCESSING
    assert row.error == "warehouse down"
    assert list(leases.expired(now=timezone.now() + timedelta(seconds=1))) == [row]
    assert not leases.fail(row.pk, reason="x", attempt=row.attempts + 1)  # fenced
    assert leases.fail(row.pk, reason="operator")
    assert claim().state is ClaimState.FAILED
    assert not leases.fail(row.pk, reason="again")  # idempotent: nothing left to fail


@pytest.mark.django_db(transaction=True)
def test_heartbeating_extends_the_lease_and_reports_a_lost_one() -> None:
    lease = claim(ttl=1).lease
    assert lease is not None
    with leases.heartbeating(lease, every=0.2) as lost:
        time.sleep(1.5)
        assert not lost.is_set()
    row = ProcessedMessage.objects.get(pk=lease.pk)
    assert row.lease_expires_at is not None
    assert row.lease_expires_at > lease.expires_at
    taken = leases.takeover(row, force=True)
    assert taken is not None
    with leases.heartbeating(lease, every=0.1) as lost:
        assert lost.wait(5)


class RecordingStep(LeasedStep):
    consumer = "effects"

    def __init__(self, verdict: Verification = Verification.NOT_DONE, fail: bool = False) -> None:
        self.verdict = verdict
        self.fail = fail
        self.performed: list[str] = []

    def perform(self, lease: Lease) -> None:
        self.performed.append(lease.idempotency_key)
        if self.fail:
            raise RuntimeError("boom")

    def verify(self, lease: Lease) -> Verification:
        return self.verdict

    def finish(self, lease: Lease) -> StepResult:
        return StepResult.COMPLETED if leases.complete(lease) else StepResult.SKIPPED


@pytest.mark.parametrize(
    ("verdict", "performed", "result"),
    [
        (Verification.DONE, 0, StepResult.COMPLETED),
        (Verification.NOT_DONE, 1, StepResult.COMPLETED),
        (Verification.UNKNOWN, 0, StepResult.RETRY),
    ],
)
def test_a_resumed_lease_is_verified_before_acting(verdict, performed, result) -> None:
    lease = claim().lease
    assert lease is not None
    expire(lease)
    resumed = claim().lease
    assert resumed is not None
    step = RecordingStep(verdict)
    assert leases.run_step(step, resumed) is result
    assert len(step.performed) == performed


def test_a_failing_effect_releases_the_lease_with_the_error() -> None:
    lease = claim().lease
    assert lease is not None
    assert leases.run_step(RecordingStep(fail=True), lease) is StepResult.RETRY
    row = ProcessedMessage.objects.get(pk=lease.pk)
    assert row.status == InboxStatus.PROCESSING
    assert "boom" in row.error
    assert row.lease_expires_at is not None
    assert row.lease_expires_at <= timezone.now()
