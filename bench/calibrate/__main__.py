"""`python -m bench.calibrate ...`, the same as `tandem bench calibrate ...`."""

from bench.calibrate.main import main

raise SystemExit(main())
