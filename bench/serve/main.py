"""Serving benchmark: TTFT, inter-token latency, TPOT, end-to-end latency and throughput
as an OpenAI client sees them.

Mode A drives any OpenAI-compatible endpoint:

    tandem bench serve --url http://127.0.0.1:8000 --num-prompts 100 --prompt-tokens 1024 \\
        --max-tokens 64 (--concurrency 8 | --request-rate 4) [--api completions|chat]

Mode B runs the same workload on fresh local stacks, one topology after the other, and
sets them side by side ("1p1d": one prefill and one decode worker, every request
disaggregated; "2x1": two workers serving whole requests; generally "NpMd" and "Nx1";
"2xvllm": the peer, two plain vLLM servers behind vllm-router, `bench.serve.peer`):

    tandem bench serve --compare 1p1d,2x1 --engine sim|vllm [MODEL] ...
    tandem bench serve --compare 1p1d,2x1,2xvllm --engine vllm MODEL ...

(MODEL: the model directory option every bench command declares, `bench.options.add_model_dir`;
vLLM needs one, the sim generates its own without it.)

`tandem bench serve multiturn ...` runs multi-turn conversations with the prefix pull on
and off (`bench.serve.multiturn`).

Each topology is a stack definition (`topology.stack_definition`) run as local processes
the way `tandem up` runs one (`LocalStack`), stopped before the next starts, so no cache
carries over. Workers are launched with this interpreter: run mode B with
`--engine vllm` from the vLLM venv. Prompts are seeded random words, distinct from their
first words on (`--shared-prefix-tokens` gives them a common opening); `--warmup` requests
with other prompts go first and are not measured. Requests stream with temperature 0 and
ask the server for a final usage chunk (the token counts). The stacks' services take their
other settings from `TANDEM_*` variables as usual (`TANDEM_PD_TRANSFER=push` for push); each
topology's figures include the router's count of disaggregated requests by KV transfer mode.

Prints one JSON document on stdout (mode A: `{"config", "results"}`; mode B: `{"config",
"topologies", "ratios"}`, ratios being the first topology's figure over the second's),
progress on stderr. Not a test. Each run of a workload against an endpoint is `run.run_serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.options import TINY_MODEL_HELP, add_model_dir
from bench.serve.interference import interference_settings
from bench.serve.peer import PeerPlan, PeerStack
from bench.serve.prompts import PromptSpec, one_token_per_word
from bench.serve.run import ServeWorkload, progress, run_serve, tokenizer_counter
from bench.serve.stats import Slo, ratios
from bench.serve.topology import Topology, parse_topologies, stack_definition
from launch.definition import Settings
from launch.plan import StackConfig, plan_stack
from launch.stack import LocalStack
from services.worker.vllm.options import VllmEngineOptions

DISAGGREGATED_METRIC = "tandem_router_disaggregated_requests_total"
_TRANSFER_MODE_LINE = re.compile(r'tandem_router_kv_transfer_mode_total\{mode="(\w+)"\} (\S+)')


# ---- mode B: topologies side by side ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompareSetup:
    engine: str
    model_dir: str
    log_root: Path
    sim_speedup: float = 1.0
    vllm_kv_cache_gib: float = 0.5
    worker_settings: Settings = dataclasses.field(default_factory=dict)  # more `tandem worker` options
    start_timeout_s: float = 0.0  # 0: the engine's

    def all_worker_settings(self) -> Settings:
        # every worker gets both engines' options; an engine ignores the other's
        return {"sim_speedup": self.sim_speedup, "vllm_kv_cache_gib": self.vllm_kv_cache_gib, **self.worker_settings}


def stack_config(setup: CompareSetup, topology: Topology) -> StackConfig:
    definition = stack_definition(topology, setup.engine, setup.model_dir, setup.all_worker_settings())
    return plan_stack(definition, log_dir=str(setup.log_root / topology.name), cores=sorted(os.sched_getaffinity(0)),
                      start_timeout_s=setup.start_timeout_s)


def peer_stack(setup: CompareSetup, topology: Topology) -> PeerStack:
    """The "Nxvllm" peer: plain vLLM servers with the Tandem workers' engine settings (`main`
    runs a peer only beside vLLM workers), given as long to start as such a worker."""
    from services.worker.engines import engine_spec

    engine = VllmEngineOptions(model_dir=setup.model_dir, kv_cache_gib=setup.vllm_kv_cache_gib,
                               **{key: value for key, value in setup.worker_settings.items() if key == "max_model_len"})
    log_dir = setup.log_root / topology.name
    shutil.rmtree(log_dir, ignore_errors=True)
    return PeerStack(PeerPlan(topology.peer, engine, sorted(os.sched_getaffinity(0))), log_dir,
                     setup.start_timeout_s or engine_spec(setup.engine).start_timeout_s)


def _stack(setup: CompareSetup, topology: Topology) -> LocalStack | PeerStack:
    if topology.peer:
        progress(f"{topology.name}: starting {topology.peer} plain vLLM servers behind vllm-router")
        return peer_stack(setup, topology)
    config = stack_config(setup, topology)
    progress(f"{topology.name}: starting {len(config.workers)} {setup.engine} workers "
              f"({', '.join(spec.role.value for spec in config.workers)})")
    shutil.rmtree(config.log_dir, ignore_errors=True)
    return LocalStack(config)


def compare(topologies: list[Topology], workload: ServeWorkload, setup: CompareSetup) -> dict:
    """Each topology's results (or the reason it has none), then first-over-second ratios."""
    count_tokens = tokenizer_counter(setup.model_dir)
    results: dict[str, dict] = {}
    for topology in topologies:
        stack = _stack(setup, topology)
        try:
            stack.start()
        except (RuntimeError, TimeoutError) as error:  # this topology says so; the others still run
            progress(f"{topology.name}: the stack did not start: {error}")
            results[topology.name] = {"error": f"stack did not start: {error}"[:500]}
            continue
        try:
            _, figures = asyncio.run(run_serve(stack.router_url, workload, count_tokens=count_tokens,
                                               label=topology.name))
            metrics = None if topology.peer else _router_metrics(stack.router_url)  # warm-up included in both
            figures["disaggregated_requests"] = _disaggregated(metrics)
            figures["kv_transfer_modes"] = _transfer_modes(metrics)
        except httpx.HTTPError as error:  # no model list: nothing was measured
            progress(f"{topology.name}: the run failed: {error!r}")
            results[topology.name] = {"error": f"run failed: {error!r}"[:500]}
            continue
        finally:
            stack.stop()
        progress(f"{topology.name}: ttft p50 {figures['ttft_ms']['p50']} ms, itl p50 {figures['itl_ms']['p50']} ms, "
                  f"{figures['output_throughput_tok_s']} tok/s, {figures['errors']} errors")
        results[topology.name] = figures
    first, second = (results[topology.name] for topology in topologies[:2])
    return {"topologies": results,
            "ratios": ratios(first, second) if "error" not in first and "error" not in second else {}}


def _router_metrics(router_url: str) -> str | None:
    """The router's /metrics text; None when it does not answer."""
    try:
        return httpx.get(f"{router_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None


def _disaggregated(metrics: str | None) -> int | None:
    """Requests the router served with a prefill and a decode worker."""
    if metrics is None:
        return None
    for line in metrics.splitlines():
        if line.startswith(DISAGGREGATED_METRIC + " "):
            return int(float(line.split()[1]))
    return 0


def _transfer_modes(metrics: str | None) -> dict[str, int] | None:
    """Disaggregated requests by how the prompt's KV reached the decode worker (pull, push)."""
    if metrics is None:
        return None
    modes: dict[str, int] = {}
    for line in metrics.splitlines():
        if match := _TRANSFER_MODE_LINE.fullmatch(line):
            modes[match.group(1)] = int(float(match.group(2)))
    return modes


# ---- command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from services.worker.engines import engine_names

    parser = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="mode A: an OpenAI-compatible server (http://HOST:PORT)")
    target.add_argument("--compare", help="mode B: topologies on local stacks, e.g. 1p1d,2x1,2xvllm")
    parser.add_argument("--model", default="", help="mode A: model name (default: the first of /v1/models)")
    parser.add_argument("--api-key-file", default="", help="mode A: a file holding the server's API key "
                                                           "(`tandem up`: STATE_DIR/api-key)")
    parser.add_argument("--tokenizer", default="", help="mode A: model directory whose tokenizer sizes the prompts "
                                                        "(default: one token per word)")
    parser.add_argument("--api", choices=("completions", "chat"), default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--shared-prefix-tokens", type=int, default=0, help="tokens every prompt opens with")
    parser.add_argument("--max-tokens", type=int, default=64)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="requests in flight (closed loop; default 1)")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (open loop)")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it is an error")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, Tandem; not OpenAI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="with --slo-itl-ms: report goodput, the requests/s within both bounds")
    parser.add_argument("--slo-itl-ms", type=float, default=None,
                        help="the SLO's bound on a request's time per output token after the first")
    parser.add_argument("--per-request", action="store_true",
                        help="each run's results also list every measured request: its send time, TTFT and "
                             "inter-chunk gaps (to trace a tail to its requests)")
    parser.add_argument("--engine", choices=engine_names(), default="sim", help="mode B: worker engine")
    add_model_dir(parser, help_text="mode B: " + TINY_MODEL_HELP)
    parser.add_argument("--state-dir", default=".tandem/bench-serve", help="mode B: logs and the generated model")
    parser.add_argument("--sim-speedup", type=float, default=1.0, help="mode B, sim: run the sim this much faster")
    parser.add_argument("--sim-profile", default="", help="mode B, sim: the workers' timing profile (a JSON file "
                        "or a packaged name, docs/sim-profiles.md)")
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=0.5, help="mode B, vllm: KV cache per worker")
    parser.add_argument("--max-model-len", type=int, default=0, help="mode B: worker flag (default: the worker's)")
    parser.add_argument("--start-timeout", type=float, default=0.0,
                        help="mode B: seconds for a stack to start (default: the engine's start timeout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["multiturn"]:  # conversations, prefix pull on and off (bench.serve.multiturn)
        from bench.serve.multiturn import main as multiturn_main

        return multiturn_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.slo_ttft_ms is None) != (args.slo_itl_ms is None):
        parser.error("--slo-ttft-ms and --slo-itl-ms go together")
    try:
        slo = Slo(args.slo_ttft_ms, args.slo_itl_ms) if args.slo_ttft_ms is not None else None
        workload = ServeWorkload(
            prompts=PromptSpec(count=args.num_prompts, prompt_tokens=args.prompt_tokens,
                               shared_prefix_tokens=args.shared_prefix_tokens, seed=args.seed),
            max_tokens=args.max_tokens, api=args.api, concurrency=args.concurrency or 1,
            request_rate=args.request_rate, warmup=args.warmup, timeout_s=args.timeout, ignore_eos=args.ignore_eos,
            slo=slo, per_request=args.per_request)
        interference = interference_settings(slo, args.max_tokens, engine=args.engine, sim_profile=args.sim_profile,
                                             sim_speedup=args.sim_speedup)
        topologies = [dataclasses.replace(topology, **interference) if topology.any_prefill else topology
                      for topology in (parse_topologies(args.compare) if args.compare else [])]
    except ValueError as error:
        parser.error(str(error))
    from services.worker.engines import engine_spec

    if any(topology.peer for topology in topologies) and not engine_spec(args.engine).has_plain_server:
        parser.error(f"an Nxvllm peer runs beside workers whose engine has a plain server of its own, "
                     f"not {args.engine}: add --engine vllm")
    if workload.max_tokens < 1 or workload.concurrency < 1 or (workload.request_rate or 1) <= 0:
        parser.error("--max-tokens, --concurrency and --request-rate must be positive")
    document = _serve_url(args, workload) if args.url else _compare_stacks(args, topologies, workload)
    if document is None:
        return 1
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def _serve_url(args: argparse.Namespace, workload: ServeWorkload) -> dict | None:
    """Mode A: the run against the server at `--url`; None when its model list cannot be read."""
    count_tokens = tokenizer_counter(args.tokenizer) if args.tokenizer else one_token_per_word
    try:
        api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else ""
        model, results = asyncio.run(run_serve(args.url, workload, args.model, count_tokens, api_key=api_key))
    except httpx.HTTPError as error:  # only the model list can raise: requests record their failures
        progress(f"cannot read {args.url}/v1/models: {error!r}")
        return None
    return {"config": {"url": args.url, "model": model, **workload.config()}, "results": results}


def _compare_stacks(args: argparse.Namespace, topologies: list[Topology], workload: ServeWorkload) -> dict:
    """Mode B: the run against a local stack per topology of `--compare`."""
    from shared.tiny_model import model_dir_or_tiny

    state_dir = Path(args.state_dir)
    setup = CompareSetup(engine=args.engine, model_dir=model_dir_or_tiny(args.model_dir, state_dir),
                         log_root=state_dir / "logs", sim_speedup=args.sim_speedup,
                         vllm_kv_cache_gib=args.vllm_kv_cache_gib,
                         worker_settings={**({"max_model_len": args.max_model_len} if args.max_model_len else {}),
                                          **({"sim_profile": args.sim_profile} if args.sim_profile else {})},
                         start_timeout_s=args.start_timeout)
    return {"config": {"compare": [topology.name for topology in topologies], "engine": setup.engine,
                       "model_dir": setup.model_dir, "sim_speedup": setup.sim_speedup, **workload.config()},
            **compare(topologies, workload, setup)}


if __name__ == "__main__":
    sys.exit(main())
