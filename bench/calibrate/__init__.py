"""`tandem bench calibrate`: measure a real transformer's step timings with PyTorch and fit
the sim's timing profile to them.

- `bench.calibrate.measure`: the measurements (torch and transformers, imported lazily;
  nothing from Tandem, so it also runs alone on a GPU machine);
- `bench.calibrate.fit`: the least-squares fit, pure numpy;
- `bench.calibrate.main`: the command line, which writes the raw measurements and the
  profile as JSON files and prints a summary document on stdout.
"""
