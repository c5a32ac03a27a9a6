"""`tandem bench planner`: the SLO planner against static prefill/decode splits on a shifting workload."""
