"""The ledger: files, batches, shards, requests and results in one database, the source of truth."""
