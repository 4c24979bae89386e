"""The harness that the tests and the benchmarks share: a deployment of the service on this
machine, as a test or a bench run needs it.

- `servers`: the PostgreSQL and Redis servers (the configured or local ones, else throwaway
  servers from the local binaries) and `free_port`;
- `databases`: a database of its own per run, migrated or copied from a migrated template, and
  an emptied Redis database;
- `stack`: the API and worker processes (`Stack`) and their environment;
- `batches`: the client's side: batch files, submit, wait, download, API keys;
- `load`: many clients polling a batch (locust, of the dev extras).

Nothing here needs pytest; the test suite's fixtures (tests/conftest.py) wrap these.
"""

from conveyor.testing.batches import (
    ApiKey,
    batch_lines,
    create_key,
    download,
    run_keys,
    submit_batch,
    upload_file,
    wait_for,
    write_jsonl,
)
from conveyor.testing.servers import LocalPostgres, LocalRedis, ServerMissing, free_port
from conveyor.testing.stack import (
    Stack,
    embedded_serve,
    resident_kib,
    serve_on_free_port,
    service_deployment,
    service_env,
    stack_env,
    stop_group,
)

__all__ = [
    "ApiKey",
    "LocalPostgres",
    "LocalRedis",
    "ServerMissing",
    "Stack",
    "batch_lines",
    "create_key",
    "download",
    "embedded_serve",
    "free_port",
    "resident_kib",
    "run_keys",
    "serve_on_free_port",
    "service_deployment",
    "service_env",
    "stack_env",
    "stop_group",
    "submit_batch",
    "upload_file",
    "wait_for",
    "write_jsonl",
]
