"""API keys on the router's HTTP API.

- `limits`: pure per-key limits (a token bucket for the request rate, a count of requests
  in flight), fed `now` by the caller;
- `decision`: pure: which key a request presents, and whether it may pass (`authorize`);
- `middleware`: the ASGI adapter `create_app` installs when a key file is configured: it
  reads the clock and the watched key file (`shared.api_keys_file`), answers 401/429 as
  OpenAI error bodies, names the key on the request's span and in the router's metrics.

The key file's format and its lookup are in `shared.api_keys`: the metrics collector
reads the same files.
"""
