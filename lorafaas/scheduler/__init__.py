"""Pure policy (no I/O, no torch): pre-loading, adaptive batching, offloading, placement, keep-alive."""
