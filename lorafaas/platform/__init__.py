"""Control plane: CLI, model store, adapter tooling; later the gateway, registry, node agent and backends."""
