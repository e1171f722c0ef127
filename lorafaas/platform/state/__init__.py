"""State stores: function specs, invocations and API keys behind one interface (SQLite | Redis)."""
