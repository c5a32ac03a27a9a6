"""Tandem's services: router, orchestrator, metrics collector, engine worker, and the CLI."""
