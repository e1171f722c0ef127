"""Trace replay and cluster simulation: Azure trace parsers (`traces`), workload building (`workload`), the live
replay driver (`live`) and its reports (`report`), and the discrete-event cluster simulator (`sim`)."""
