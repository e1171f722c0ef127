"""Trace parsers, workload mapping, live replay and the cluster simulator."""
