"""Capacity planning by simulation (`tandem plan`): a discrete-event model of a P/D cluster
of sim workers driven by the sim engine's own timing profile, a sweep of P:D splits within a
worker budget, and a check of the model against real sim-worker stacks (`--verify`)."""
