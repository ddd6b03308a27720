from typing import Any

from django.db import migrations, models
from django.db.models import Q

#: 0001's full indexes that leave the models' state. MariaDB keeps both: without
#: partial indexes, nothing else serves the reconciler's and the admin's filters there.
STATUS_LEASE = models.Index(
    fields=["status", "lease_expires_at"], name="idempotent__status_88dabc_idx"
)
OUTCOME = models.Index(fields=["outcome"], name="idempotent__outcome_353f4e_idx")

#: An operator filters on the rare outcomes. A filter on "applied" (most rows) walks
#: the primary key and fills a page at once, so its entries would only cost space.
#: The outcome alone, not (outcome, id): PostgreSQL stores a repeated key once per
#: page (deduplication), a unique id defeats that and made it 10 bytes a row at size.
RARE_OUTCOME = models.Index(
    fields=["outcome"], name="io_inbox_outcome_rare", condition=~Q(outcome="applied")
)


def leaner(apps: Any, schema_editor: Any) -> None:
    if not schema_editor.connection.features.supports_partial_indexes:
        return
    model = apps.get_model("idempotent_orders", "processedmessage")
    # 0010's io_inbox_stuck (processing) and io_inbox_attention (failed, dead,
    # rejected) serve every query on status this index served; "done" is never
    # looked up by status alone except by the purge, which walks created_at.
    schema_editor.remove_index(model, STATUS_LEASE)
    schema_editor.add_index(model, RARE_OUTCOME)
    schema_editor.remove_index(model, OUTCOME)


def fuller(apps: Any, schema_editor: Any) -> None:
    if not schema_editor.connection.features.supports_partial_indexes:
        return
    model = apps.get_model("idempotent_orders", "processedmessage")
    schema_editor.add_index(model, OUTCOME)
    schema_editor.remove_index(model, RARE_OUTCOME)
    schema_editor.add_index(model, STATUS_LEASE)


class Migration(migrations.Migration):

    dependencies = [
        ('idempotent_orders', '0010_admin_at_size_indexes'),
    ]

    operations = [
        # The state loses both indexes on every database; which ones a database has
        # is the RunPython's business, by its features, as in 0010.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name='processedmessage', name=STATUS_LEASE.name),
                migrations.RemoveIndex(model_name='processedmessage', name=OUTCOME.name),
            ],
            database_operations=[migrations.RunPython(leaner, fuller, elidable=False)],
        ),
    ]
