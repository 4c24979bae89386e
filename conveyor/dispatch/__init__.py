"""How shard tasks travel between the API and the workers, apart from both: the Celery app and
its queues, prefix-affinity routing, what the broker holds, and the reconciler that re-sends
what nothing carries. Torch-free: the API sends and reconciles with it too."""
