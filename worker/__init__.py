"""Celery workers that feed one long-lived engine per process, and the reconciler."""
