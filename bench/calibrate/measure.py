"""Measure a real transformer's step timings with PyTorch: the raw half of `tandem bench calibrate`.

A Llama-architecture model (transformers' `LlamaForCausalLM`) is built from a config with
random weights, in bf16 on a CUDA device (fp32 on CPU), and timed on:

- prefill: one forward pass over whole prompts (batch 1 at each length, plus a few batches
  of equal chunks), logits for the last position only, as a serving engine computes them;
- decode: one token for each of B sequences whose KV cache (a preallocated `StaticCache`)
  holds `context` tokens;
- every step eagerly and, on CUDA, replayed from a captured CUDA graph (how serving engines
  run small steps);
- per-layer split: CUDA events (wall clock on CPU) around the embedding, every decoder
  layer and the final norm + LM head, in one prefill and one decode step.

`measure(shape, plan)` returns a plain JSON-able dict (the raw measurements file) and
reports progress through `log`. torch and transformers are imported here, lazily, and
nothing from Tandem outside this package is, so it runs alone on a GPU machine;
`bench.calibrate.fit` turns its output into the sim's timing profile. Decode attention reads
only the filled KV, as serving engines do (`bench.calibrate.attention`), unless the plan
asks for transformers' stock path.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

Log = Callable[[str], None]
_ATTENTION: dict[str, Any] = {}  # "state": the prefix attention's, when installed


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """An 8B-like Llama by default (hidden 4096, 32 layers, GQA 32/8, vocab 128256)."""

    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 14336
    vocab_size: int = 128256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    prefill_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    prefill_batches: tuple[tuple[int, int], ...] = ((2, 1024), (4, 512), (8, 256), (2, 4096), (4, 2048))
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_contexts: tuple[int, ...] = (1024, 4096)
    layer_prefill_tokens: int = 2048
    layer_decode_batch: int = 32
    warmup: int = 2
    iters: int = 5
    device: str = "auto"  # "auto": CUDA when present, else CPU
    cuda_graphs: bool = True
    attention: str = "prefix"  # "prefix": decode reads only the filled KV (bench.calibrate.attention); "stock"


def stderr_log(message: str) -> None:
    print(f"[calibrate] {message}", file=sys.stderr, flush=True)


def measure(shape: ModelShape, plan: Plan, log: Log = stderr_log) -> dict[str, Any]:
    import torch

    started = time.perf_counter()
    device = torch.device("cuda" if plan.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if plan.device == "auto" else plan.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = _Timer(torch, device, plan.warmup, plan.iters)
    model = _build_model(torch, shape, device, dtype, max(plan.prefill_lengths + (plan.layer_prefill_tokens,)), log)
    if plan.attention not in ("prefix", "stock"):
        raise ValueError(f"attention must be 'prefix' or 'stock', not {plan.attention!r}")
    if "state" in _ATTENTION:  # an earlier call's prefix attention stays registered: turn it off
        _ATTENTION.pop("state")["filled"] = None
    if plan.attention == "prefix":
        from bench.calibrate.attention import install

        _ATTENTION.update(state=install(torch))
    raw: dict[str, Any] = {"device": _describe(torch, device, dtype), "shape": dataclasses.asdict(shape),
                           "plan": dataclasses.asdict(plan), "prefill": [], "decode": [], "layers": [],
                           "skipped": []}
    with torch.inference_mode():
        graphs = {"enabled": plan.cuda_graphs and device.type == "cuda"}  # off after a failed capture
        for batch, length in [(1, n) for n in plan.prefill_lengths] + list(plan.prefill_batches):
            raw["prefill"] += _prefill_points(torch, model, shape, graphs, timer, device, batch, length,
                                              raw["skipped"], log)
        for context in plan.decode_contexts:
            for batch in plan.decode_batches:
                raw["decode"] += _decode_points(torch, model, shape, graphs, timer, device, dtype, batch, context,
                                                raw["skipped"], log)
        split = (("prefill", 1, plan.layer_prefill_tokens), ("decode", plan.layer_decode_batch, 1))
        for kind, batch, tokens in split:
            try:
                raw["layers"].append(_layer_split(torch, model, shape, device, kind, batch, tokens,
                                                  plan.decode_contexts[0], dtype))
            except Exception as error:  # recorded, not fatal: the step timings stand alone
                raw["skipped"].append({"phase": f"layers-{kind}", "why": f"{type(error).__name__}: {error}"[:300]})
        log(f"layer split: {len(raw['layers'])} steps")
    raw["elapsed_s"] = round(time.perf_counter() - started, 1)
    return raw


class _Timer:
    """Median-friendly samples in ms: `warmup` untimed calls, then `iters` timed ones, each
    bracketed by synchronisations so the time is the whole step as a caller sees it."""

    def __init__(self, torch: Any, device: Any, warmup: int, iters: int) -> None:
        self._torch, self._device, self._warmup, self._iters = torch, device, warmup, iters

    def _sync(self) -> None:
        if self._device.type == "cuda":
            self._torch.cuda.synchronize(self._device)

    def run(self, step: Callable[[], Any]) -> list[float]:
        for _ in range(self._warmup):
            step()
        self._sync()
        samples = []
        for _ in range(self._iters):
            begin = time.perf_counter()
            step()
            self._sync()
            samples.append(round((time.perf_counter() - begin) * 1000, 4))
        return samples


def _build_model(torch: Any, shape: ModelShape, device: Any, dtype: Any, max_len: int, log: Log) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                         max_position_embeddings=max(max_len, 8192) + 64, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    began = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    log(f"model built on {device} in {time.perf_counter() - began:.1f} s: {params / 1e9:.2f} B parameters, {dtype}")
    return model


def _describe(torch: Any, device: Any, dtype: Any) -> dict[str, Any]:
    import transformers

    info = {"type": device.type, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


def _free(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _static_cache(model: Any, batch: int, max_len: int, device: Any, dtype: Any) -> Any:
    from transformers import StaticCache

    try:  # transformers 5: layers are allocated lazily, on the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len, device=device,
                           dtype=dtype)


def _decode_step(torch: Any, model: Any, batch: int, context: int, device: Any, dtype: Any
                 ) -> tuple[Callable[[], Any], Any]:
    """One decode step for `batch` sequences at position `context` of a static cache (the
    cache's contents do not change the work: attention reads all `context` positions)."""
    cache = _static_cache(model, batch, context + 8, device, dtype)
    if "state" in _ATTENTION:
        _ATTENTION["state"]["filled"] = context + 1  # the context plus the token this step writes
    ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
    position = torch.tensor([context], dtype=torch.long, device=device)

    def step() -> Any:
        return model(input_ids=ids, past_key_values=cache, cache_position=position, use_cache=True).logits

    return step, cache


def _decode_points(torch: Any, model: Any, shape: ModelShape, graphs: dict[str, bool], timer: _Timer, device: Any,
                   dtype: Any, batch: int, context: int, skipped: list[dict[str, Any]], log: Log
                   ) -> list[dict[str, Any]]:
    kv_bytes = shape.kv_bytes_per_token(dtype.itemsize) * batch * (context + 8)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if kv_bytes > 0.8 * free:
            skipped.append({"phase": "decode", "batch": batch, "context": context,
                            "why": f"KV cache {kv_bytes / 2**30:.1f} GiB > 80% of {free / 2**30:.1f} GiB free"})
            log(f"decode {batch} seqs @ {context}: KV cache does not fit, skipped")
            return []
    step, cache = _decode_step(torch, model, batch, context, device, dtype)
    try:
        return _timed(torch, step, graphs, timer, {"batch": batch, "context": context},
                      f"decode {batch} seqs @ {context}", skipped, log)
    finally:
        del step, cache
        _free(torch, device)


def _prefill_points(torch: Any, model: Any, shape: ModelShape, graphs: dict[str, bool], timer: _Timer, device: Any,
                    batch: int, length: int, skipped: list[dict[str, Any]], log: Log) -> list[dict[str, Any]]:
    ids = torch.randint(0, shape.vocab_size, (batch, length), device=device)

    def step() -> Any:
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    try:
        return _timed(torch, step, graphs, timer, {"batch": batch, "length": length, "tokens": batch * length},
                      f"prefill {batch}x{length}", skipped, log)
    finally:
        del step
        _free(torch, device)


def _timed(torch: Any, step: Callable[[], Any], graphs: dict[str, bool], timer: _Timer, key: dict[str, int],
           label: str, skipped: list[dict[str, Any]], log: Log) -> list[dict[str, Any]]:
    """Eager samples, then (CUDA) samples of the step replayed from a captured graph."""
    points = []
    try:
        eager = timer.run(step)
        points.append({**key, "mode": "eager", "ms": eager, "median_ms": statistics.median(eager)})
        line = f"{label}: eager {statistics.median(eager):.2f} ms"
        if graphs["enabled"]:
            try:
                replay = _capture(torch, step)
                graphed = timer.run(replay)
                del replay
                points.append({**key, "mode": "cuda_graph", "ms": graphed, "median_ms": statistics.median(graphed)})
                line += f", graph {statistics.median(graphed):.2f} ms"
            except Exception as error:  # capture is best effort: eager timings stand alone
                skipped.append({**key, "phase": "cuda_graph", "why": f"{type(error).__name__}: {error}"[:300]})
                line += f", graph failed ({type(error).__name__}), no more captures"
                graphs["enabled"] = False
        log(line)
    except Exception as error:  # out of memory, or an API this transformers lacks: recorded, not fatal
        skipped.append({**key, "phase": "step", "why": f"{type(error).__name__}: {error}"[:300]})
        log(f"{label}: {type(error).__name__}, skipped")
    return points


def _capture(torch: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _layer_split(torch: Any, model: Any, shape: ModelShape, device: Any, kind: str, batch: int, tokens: int,
                 context: int, dtype: Any) -> dict[str, Any]:
    """Time of the embedding, each decoder layer and the head in one step (mean of 3)."""
    modules = [("embed", model.model.embed_tokens)] + [(f"layer{i}", layer) for i, layer in
                                                       enumerate(model.model.layers)]
    modules += [("norm", model.model.norm), ("head", model.lm_head)]
    marks: dict[str, list[Any]] = {}
    cuda = device.type == "cuda"

    def stamp() -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    hooks = []
    for name, module in modules:
        hooks.append(module.register_forward_pre_hook(lambda *_, n=name: marks.setdefault(n, []).append(stamp())))
        hooks.append(module.register_forward_hook(lambda *_, n=name: marks[n].append(stamp())))
    if kind == "prefill":
        ids = torch.randint(0, shape.vocab_size, (batch, tokens), device=device)

        def step() -> Any:
            return model(input_ids=ids, use_cache=False, logits_to_keep=1)
        cache = None
    else:
        step, cache = _decode_step(torch, model, batch, context, device, dtype)
    try:
        step()  # warm-up, not recorded
        marks.clear()
        began = time.perf_counter()
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        total_ms = (time.perf_counter() - began) * 1000 / 3
    finally:
        for hook in hooks:
            hook.remove()
        del cache
    per_module = {}
    for name, stamps in marks.items():
        pairs = list(zip(stamps[0::2], stamps[1::2]))
        spans = [a.elapsed_time(b) if cuda else (b - a) * 1000 for a, b in pairs]
        per_module[name] = round(sum(spans) / len(spans), 4)
    layers = [per_module[f"layer{i}"] for i in range(shape.num_layers)]
    return {"kind": kind, "batch": batch, "tokens": tokens, "context": context if kind == "decode" else 0,
            "embed_ms": per_module["embed"], "layer_ms": layers, "norm_ms": per_module["norm"],
            "head_ms": per_module["head"], "total_ms": round(total_ms, 4)}
