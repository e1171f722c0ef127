"""The discrete-event cluster simulator: cluster specs, cost model, policies, engine, runner."""
