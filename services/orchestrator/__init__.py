"""The orchestrator: owns membership (`membership.py`, `service.py`: removes workers whose
heartbeats stop) and serves the control plane (`control_plane.py`: cordon, drain, set-role,
add and remove workers, checked by the pure `command_checks.py`, workers started through
`launchers/`). Run by `tandem orchestrator` (`main.py`); commands come from `tandem ctl`.
"""
