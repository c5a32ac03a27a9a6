"""`tandem bench calibrate`: measure (or read `--from-raw`), fit, write the profile.

Progress goes to stderr; stdout gets one JSON document: the fitted profile, the fit's
relative errors and the files written. `--raw-out` keeps the measurements, `--profile-out`
the profile in the form `--sim-profile` loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from bench.calibrate.fit import decode_points, fit_profile, prefill_points
from bench.calibrate.measure import ModelShape, Plan, measure, stderr_log


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _batches(text: str) -> tuple[tuple[int, int], ...]:
    """"2x1024,4x512": batches of equal chunks (sequences x tokens each); "" for none."""
    try:
        pairs = [tuple(int(n) for n in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH,..., got {text!r}") from error
    if any(len(pair) != 2 or min(pair) < 1 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH,..., got {text!r}")
    return tuple((batch, length) for batch, length in pairs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    shape, plan = ModelShape(), Plan()
    parser = argparse.ArgumentParser(prog="tandem bench calibrate", description=__doc__.splitlines()[0])
    model = parser.add_argument_group("model shape (a Llama built from a config, random weights)")
    model.add_argument("--hidden", type=int, default=shape.hidden_size)
    model.add_argument("--layers", type=int, default=shape.num_layers)
    model.add_argument("--heads", type=int, default=shape.num_heads)
    model.add_argument("--kv-heads", type=int, default=shape.num_kv_heads)
    model.add_argument("--intermediate", type=int, default=shape.intermediate_size)
    model.add_argument("--vocab", type=int, default=shape.vocab_size)
    runs = parser.add_argument_group("what to time")
    runs.add_argument("--prefill-lengths", type=_ints, default=plan.prefill_lengths)
    runs.add_argument("--prefill-batches", type=_batches, default=plan.prefill_batches,
                      help="batches of equal chunks, e.g. 2x1024,4x512 ('' for none)")
    runs.add_argument("--decode-batches", type=_ints, default=plan.decode_batches)
    runs.add_argument("--decode-contexts", type=_ints, default=plan.decode_contexts,
                      help="KV cache length of each sequence in a decode step; the fit uses the first")
    runs.add_argument("--warmup", type=int, default=plan.warmup)
    runs.add_argument("--iters", type=int, default=plan.iters)
    runs.add_argument("--device", default=plan.device, help="auto (CUDA when present), cuda, cuda:1, cpu")
    runs.add_argument("--no-cuda-graphs", action="store_true", help="time steps eagerly only")
    runs.add_argument("--attention", choices=("prefix", "stock"), default=plan.attention,
                      help="decode attention: over the filled KV only, as serving engines do (prefix), "
                           "or transformers' stock masked SDPA over the whole static cache")
    out = parser.add_argument_group("fit and output")
    out.add_argument("--from-raw", type=Path, help="fit a raw measurements file instead of measuring")
    out.add_argument("--raw-out", type=Path, help="write the raw measurements here")
    out.add_argument("--profile-out", type=Path, help="write the fitted profile here")
    out.add_argument("--name", default="calibrated", help="the profile's name")
    out.add_argument("--fit-layers", type=int, default=None,
                     help="pool the layer weights into this many layers (the sim's --sim-layers)")
    out.add_argument("--mode", dest="mode", choices=("auto", "eager", "cuda_graph"), default="auto",
                     help="which timings to fit: auto takes the faster of eager and CUDA-graph replay per point")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.from_raw:
        raw = json.loads(args.from_raw.read_text())
    else:
        shape = ModelShape(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab)
        plan = Plan(prefill_lengths=args.prefill_lengths, prefill_batches=args.prefill_batches,
                    decode_batches=args.decode_batches, decode_contexts=args.decode_contexts,
                    warmup=args.warmup, iters=args.iters, device=args.device, cuda_graphs=not args.no_cuda_graphs,
                    attention=args.attention)
        raw = measure(shape, plan)
        if args.raw_out:  # before fitting: the measurements survive a failed fit
            args.raw_out.write_text(json.dumps(raw, indent=1) + "\n")
            stderr_log(f"raw measurements: {args.raw_out}")
    profile, fit = fit_profile(raw, name=args.name, num_layers=args.fit_layers, mode=args.mode)
    context, decode = decode_points(raw, args.mode)
    prefill = prefill_points(raw, args.mode)
    if args.profile_out:
        args.profile_out.write_text(json.dumps(msgspec.to_builtins(profile), indent=2) + "\n")
        stderr_log(f"profile: {args.profile_out}")
    return {"profile": msgspec.to_builtins(profile), "fit": msgspec.to_builtins(fit),
            "device": raw.get("device"), "shape": raw.get("shape"), "decode_context": context,
            "decode_points": len(decode), "prefill_points": len(prefill),
            "raw_file": str(args.raw_out or args.from_raw or ""), "profile_file": str(args.profile_out or "")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (OSError, ValueError, KeyError) as error:
        print(f"tandem bench calibrate: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0
