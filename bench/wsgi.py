"""WSGI entry point of the real-server HTTP bench (gunicorn serves ``bench.urls``)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
os.environ.setdefault("BENCH_HTTP_SERVER", "1")

from django.core.wsgi import get_wsgi_application

application = get_wsgi_application()
