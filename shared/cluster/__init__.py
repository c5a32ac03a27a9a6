"""Cluster state as every service sees it: who the workers are, their load, and whether an
event stream from each is still in order.

Pure policy (synchronous, no I/O, unit-tested with plain data):
- `sequence`: `SequenceTracker`, per worker: in order, late start, gap or stale, and
  whether the consumer's view is in sync or must ask the worker for a snapshot.
- `member_events`: `MemberEvent` (joined / updated / restarted / left) and the rule that
  tells them apart (`member_change`).
- `load_stream.is_stale`: which load snapshot is older than the one already kept.

Adapters (NATS):
- `bucket_mirror.BucketMirror`: a raw JetStream key-value bucket, kept current across
  reconnects (its watcher is recreated after each one).
- `membership_mirror.MembershipMirror`: the members bucket as typed `MemberEvent`s.
- `load_stream.LoadStream`: every worker's `LoadSnapshot`, decoded, stale ones dropped.

Callers: the router (worker pool, KV index), the metrics collector, the orchestrator.
Import the modules themselves: this package imports nothing, so a pure caller (the KV
index) does not load the NATS client.
"""
