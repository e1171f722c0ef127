"""Control plane: the gateway, the function service and adapter store, auth, the node agent (instances, admission,
the step gate, metering), the state stores and the backends (local processes, Kubernetes pods)."""
