"""One time format on every page of the demo: the admin's dates read as its timeline's
(``idempotent_orders.timeline.at``: local time with seconds) and the shop's as well."""

DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATETIME_FORMAT = "Y-m-d H:i:s"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
