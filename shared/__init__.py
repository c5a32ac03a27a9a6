"""Tandem's shared package: the contracts every service agrees on.

Message schemas (msgspec), the subject catalog, typed service configs, NATS helpers
(connection, request plane, embedded server), block hashing and tracing helpers.
Nothing in here knows about a particular service.
"""
