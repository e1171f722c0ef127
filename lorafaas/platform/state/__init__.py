"""State stores: function specs, invocations, usage records and API keys behind one interface (SQLite | Redis)."""
