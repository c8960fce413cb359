"""Every leader job runs once per cadence slot however many beats trigger it: alert evaluation and the
outbox housekeeping take the same slot guard as the maintenance jobs (redbeat#230)."""

from __future__ import annotations

from magpie.alerts.evaluate import run_evaluation
from magpie.coordination.leader import claim_cadence_slot
from magpie.outbox.service import run_housekeeping


def test_a_slot_is_claimed_once(redis_client, redis_prefix):
    first = claim_cadence_slot(redis_client, redis_prefix, "x", 3600.0, 7)
    assert isinstance(first, int)
    assert claim_cadence_slot(redis_client, redis_prefix, "x", 3600.0, 8) is None
    assert claim_cadence_slot(redis_client, redis_prefix, "y", 3600.0, 8) == first  # per lock


def test_two_beats_trigger_one_alert_evaluation_per_slot(db, settings, redis_client):
    s = settings.model_copy(update={"alert_eval_interval": 3600.0})
    assert run_evaluation(redis_client, db, s, once_per_slot=True) is not None
    assert run_evaluation(redis_client, db, s, once_per_slot=True) is None  # the second beat's trigger
    assert run_evaluation(redis_client, db, s) is not None  # an operator's run is not slotted


def test_two_beats_trigger_one_outbox_housekeeping_per_slot(db, settings, redis_client):
    s = settings.model_copy(update={"outbox_housekeeping_interval": 3600.0})
    assert run_housekeeping(redis_client, db, s, once_per_slot=True) is not None
    assert run_housekeeping(redis_client, db, s, once_per_slot=True) is None
