"""The GPU's own limits, and how near a ~0.5B Llama's decode and training step come to them
(issue 54, 87). Runs on a CUDA machine with torch, transformers and peft, the project on the path:

    python -m bench.gpu --out bench/results/gpu-<kind>-<date>.json [--parts ceilings decode train] [--tiny]

`--tiny` runs the same measurements on a tiny Llama, on the CPU where there is no GPU (the dry run of
`scripts/gpu_check.sh`); its figures only show that the code runs.

Measured, each the median of timed repeats after warm-up, with CUDA events:
- ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 matmul's FLOP/s;
- decode: `generate` (transformers' path), 64 prompts x 128 new tokens, greedy, bf16, against the
  bandwidth bound: measured bandwidth / bytes each step reads (weights + KV cache at the mean
  context), times the batch; with the dynamic KV cache, and with a static one, which transformers'
  `generate` compiles on a GPU (`torch.compile`, mode reduce-overhead: each step a CUDA graph);
- the PPO sampler's own decode loop (`stages.engines.sampler.HFSampler`, sampling at temperature 1 with
  each token's log-prob, entropy and hidden state) at the same size: eager, and with `ppo.compile`'s
  static cache whose steps replay as CUDA graphs; on bf16 weights, and on float32 weights under bf16
  autocast (how PPO holds its policy);
- training step: forward + backward + AdamW on float32 master weights under bf16 autocast, model
  FLOP utilisation = 6 x parameters x tokens / time / measured matmul FLOP/s;
- LoRA's peak memory against full fine-tuning for the same step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import nullcontext

import torch

LLAMA_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=True)
TINY = dict(LLAMA_05B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=512, max_position_embeddings=512)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of `fn()` over `repeats`, timed with CUDA events (a wall clock on the CPU) after
    `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        if DEVICE == "cpu":
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings(size: int = 8192) -> dict:
    n = size * size * 16  # 1 GiB of bf16 per buffer at 8192
    src = torch.randn(n // 2, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), repeats=20)
    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    mm_s = timed(lambda: a @ b, repeats=20)
    src = dst = a = b = None  # frees the buffers (not `del`: the lambdas above name them)
    empty_cache()
    return {"copy_bandwidth_bytes_per_s": 2 * n / copy_s, "bf16_matmul_flops": 2 * size ** 3 / mm_s,
            "matmul_size": size}


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def build(shape: dict, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**shape)).to(DEVICE, dtype)


def busy_us(events) -> float:
    """Microseconds the device was busy in a profile's `key_averages()`: its kernels' own time (an operator's
    device time is its kernels', so summing over every event would count each kernel twice); on the CPU,
    every operator's own time."""
    from torch.autograd import DeviceType

    if DEVICE == "cpu":
        return sum(e.self_cpu_time_total for e in events)
    return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)


SELF_TIME = "self_device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
"""What a profile's events are ranked by: each operator's and kernel's own device time (CPU time on the CPU)."""


def profiler_activities() -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])


def top_events(events, top: int) -> list[dict]:
    """The `top` operators and kernels of a profile's `key_averages()` by their own time, each with its
    share of the device's busy time."""
    busy = busy_us(events) or 1
    ranked = sorted(events, key=lambda e: getattr(e, SELF_TIME), reverse=True)[:top]
    return [{"name": e.key[:120], "calls": e.count, "self_ms": getattr(e, SELF_TIME) / 1e3,
             "cpu_ms": e.cpu_time_total / 1e3, "share": getattr(e, SELF_TIME) / busy} for e in ranked]


def kernel_profile(fn, top: int = 10) -> dict:
    """One call of `fn` under `torch.profiler`: the device's busy time against the call's wall clock, and
    the `top` operators and kernels by their own device time."""
    from torch.profiler import profile

    with profile(activities=profiler_activities()) as profiler:
        started = time.perf_counter()
        fn()
        synchronize()
        wall = time.perf_counter() - started
    events = profiler.key_averages()
    return {"wall_ms": wall * 1e3, "busy_ms": busy_us(events) / 1e3, "top": top_events(events, top)}


def decode(limits: dict, shape: dict = LLAMA_05B, batch: int = 64, prompt: int = 64, new: int = 128,
           static: bool = False, cudnn: bool = True) -> dict:
    """`generate`'s tokens per second against the bandwidth bound, and one call profiled. `cudnn=False`
    keeps scaled-dot-product attention off cuDNN's kernels (flash, memory-efficient or math instead)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build(shape).eval()
    # a static KV cache: transformers' `generate` then compiles each decode step on a GPU (its
    # `_valid_auto_compile_criteria`; `torch.compile` mode reduce-overhead, so a step is one CUDA graph)
    options = {"cache_implementation": "static"} if static else {}
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, shape["vocab_size"], (batch, prompt), device=DEVICE)
    off_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def run():
        with torch.no_grad(), (nullcontext() if cudnn else sdpa_kernel(off_cudnn)):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, **options)

    started = time.perf_counter()
    run()  # the first call: compiles and captures where it compiles
    first = time.perf_counter() - started
    seconds = timed(run, repeats=3, warmup=1)
    profiled = kernel_profile(run)
    bound_tokens_per_s = limits["copy_bandwidth_bytes_per_s"] / step_bytes(model, batch, prompt + new / 2) * batch
    tokens_per_s = batch * new / seconds
    model = None  # frees the weights (not `del`: run() above names it)
    empty_cache()
    engine = "transformers generate" + ((" (static cache, compiled by generate)" if DEVICE == "cuda"
                                         else " (static cache)") if static else "")
    return {"engine": engine + ("" if cudnn else ", attention off cuDNN"),
            "batch": batch, "prompt_tokens": prompt, "new_tokens": new, "first_call_seconds": first,
            "parameters": params, "seconds": seconds, "tokens_per_s": tokens_per_s,
            "bandwidth_bound_tokens_per_s": bound_tokens_per_s, "fraction_of_bound": tokens_per_s / bound_tokens_per_s,
            "profile": profiled}


def step_bytes(model, batch: int, context: float) -> float:
    """What one decode step must read at least: the weights once (bf16) and every row's KV cache (bf16)
    at `context` positions."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # keys and values, bf16
    return sum(p.numel() for p in model.parameters()) * 2 + batch * context * kv_per_token


def sampler_decode(limits: dict, shape: dict = LLAMA_05B, batch: int = 64, prompt: int = 64, new: int = 128,
                   compiled: bool = False, weights=torch.bfloat16) -> dict:
    """The PPO sampler's decode loop (`HFSampler._decode`): `batch` prompts x `new` tokens at temperature
    1, each token's log-prob, entropy and hidden state kept, against the same bound as `decode`. No
    token ends a response (no stop id), so every call decodes `new` steps. `compiled`: `ppo.compile`'s
    static cache with the step replayed as a CUDA graph (on a GPU); `weights` float32 runs under bf16
    autocast, as PPO holds its policy."""
    from types import SimpleNamespace

    from stages.engines.sampler import HFSampler, Sampling
    from stages.runtime.compiling import Compiler
    from stages.runtime.models import Precision

    model = build(shape, weights).eval()
    compiler = Compiler(enabled=compiled, static_shapes=compiled, cuda_graphs=compiled and DEVICE == "cuda")
    sampler = HFSampler(model=model, tokenizer=SimpleNamespace(pad_token_id=0), stop_ids=[-1], compiler=compiler,
                        precision=Precision("bf16-mixed", torch.bfloat16))
    prompts = torch.randint(3, shape["vocab_size"], (batch, prompt)).tolist()

    def run():
        sampler.generate_ids(prompts, Sampling(new, temperature=1.0))

    started = time.perf_counter()
    run()  # the first call: compiles and captures
    first = time.perf_counter() - started
    seconds = timed(run, repeats=3, warmup=1)
    profiled = kernel_profile(run)
    bound = limits["copy_bandwidth_bytes_per_s"] / step_bytes(model, batch, prompt + new / 2) * batch
    tokens_per_s = batch * new / seconds
    model = sampler = None
    empty_cache()
    engine = ("PPO sampler, " + ("compiled, CUDA graphs" if compiled and DEVICE == "cuda" else
                                 "compiled" if compiled else "eager")
              + (", float32 weights under bf16 autocast" if weights == torch.float32 else ", bf16 weights"))
    return {"engine": engine, "batch": batch, "prompt_tokens": prompt, "new_tokens": new,
            "first_call_seconds": first, "seconds": seconds, "tokens_per_s": tokens_per_s,
            "bandwidth_bound_tokens_per_s": bound, "fraction_of_bound": tokens_per_s / bound,
            "step_ms": seconds / new * 1e3, "profile": profiled}


def train_step(limits: dict, lora: bool, shape: dict = LLAMA_05B, batch: int = 16, length: int = 512,
               checkpointing: bool = False) -> dict:
    model = build(shape, torch.float32).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(trained, lr=1e-5, fused=DEVICE == "cuda")
    ids = torch.randint(3, shape["vocab_size"], (batch, length), device=DEVICE)

    def step():
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    synchronize()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, repeats=5, warmup=1)
    peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else None
    tokens = batch * length
    # forward 2N per token, backward 4N (2N through the activations, 2N for weight gradients; LoRA's
    # frozen weights skip the latter, so its useful work is ~4N: reported, MFU counts 6N for full only)
    flops = (6 if not lora else 4) * params * tokens
    model = optimizer = None  # frees them (not `del`: step() above names them)
    empty_cache()
    return {"lora": lora, "gradient_checkpointing": checkpointing, "batch": batch, "length": length,
            "parameters": params,
            "trained_parameters": sum(p.numel() for p in trained), "seconds": seconds,
            "tokens_per_s": tokens / seconds, "model_flops_per_s": flops / seconds,
            "mfu_of_measured_matmul": flops / seconds / limits["bf16_matmul_flops"], "peak_allocated_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", nargs="+", default=["ceilings", "decode", "train"],
                        choices=["ceilings", "decode", "train"])
    parser.add_argument("--engines", nargs="+", default=["graphs", "graphs-fp32", "eager"],
                        choices=["graphs", "graphs-fp32", "eager", "generate-static", "generate"],
                        help="decode engines: the PPO sampler compiled (CUDA graphs; on bf16 or float32 weights) or "
                             "eager, transformers' generate with a static or dynamic cache")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama, small buffers: shows that the code runs")
    args = parser.parse_args()
    import transformers

    shape = TINY if args.tiny else LLAMA_05B
    record = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "cuda": torch.version.cuda, "transformers": transformers.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "model": shape}
    record["limits"] = ceilings(512 if args.tiny else 8192)  # every other part is measured against these
    print(json.dumps(record["limits"]), flush=True)
    if "decode" in args.parts:
        small = dict(batch=4, prompt=8, new=8) if args.tiny else {}
        record["decode"] = []
        engines = {"graphs": lambda: sampler_decode(record["limits"], shape, compiled=True, **small),
                   "graphs-fp32": lambda: sampler_decode(record["limits"], shape, compiled=True, weights=torch.float32,
                                                         **small),
                   "eager": lambda: sampler_decode(record["limits"], shape, **small),
                   "generate-static": lambda: decode(record["limits"], shape, static=True, **small),
                   "generate": lambda: decode(record["limits"], shape, **small)}
        for name in args.engines:
            measure = engines[name]
            try:
                record["decode"].append(measure())
            except Exception as e:  # noqa: BLE001 - a failed engine is a result; the others still run
                import traceback

                record["decode"].append({"engine": name, "error": f"{type(e).__name__}: {e}"[:600],
                                         "traceback": traceback.format_exc()[-2000:]})
                empty_cache()
            print(json.dumps(record["decode"][-1]), flush=True)
            with open(args.out, "w") as f:  # kept if a later part runs past the caller's limit
                json.dump(record, f, indent=1)
    if "train" in args.parts:
        small = dict(batch=2, length=16) if args.tiny else {}
        cases = ((False, None), (True, None), (False, 32)) if not args.tiny else ((False, None),)
        record["train"] = [train_step(record["limits"], lora=lora, shape=shape, checkpointing=ckpt,
                                      **(small or {"batch": batch or 16}))
                           for ckpt, batch in cases for lora in (False, True)]
        for r in record["train"]:
            print(json.dumps({k: r[k] for k in ("lora", "gradient_checkpointing", "batch", "seconds",
                                                 "mfu_of_measured_matmul", "peak_allocated_bytes")}), flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
