"""Smoke checks against a running stack (an OpenAI endpoint), as a user would make them."""
