"""Launching Tandem: the stack definition (data, `launch/stacks/*.toml`), the local-process
launcher and `tandem up`. It sits on top of the services and starts them; no service
imports it.

- `definition`: the declarative stack (services, settings, dependencies), loaded and validated;
- `plan`: a definition expanded into service instances for one local stack (`StackConfig`);
- `argv`: those instances as `tandem <service>` command lines;
- `process`: child processes (own session, parent-death signal, log file each);
- `readiness`: health endpoints and membership registrations, waited on with a deadline;
- `stack`: `LocalStack`, one running stack (the end-to-end tests and benchmarks use it too);
- `load_reports`: `LatestLoads`, each worker's latest load report off the bus, for a stack's observers;
- `up`: `tandem up`.
"""
