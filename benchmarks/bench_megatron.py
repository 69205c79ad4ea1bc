"""A Megatron-core GPT's training step with attn_dispatch's core attention against Megatron's local core attention
(its path without Transformer Engine): step time, peak memory and the loss curve of each, same initial weights and
data, and the decision of one layer (what ran, and why).

The model is built by megatron-core from get_gpt_layer_local_spec(): the `dispatch` path swaps its core attention
with attn_dispatch.integrations.megatron.with_attn_dispatch, `local` keeps Megatron's DotProductAttention. Training
is Megatron's bf16 recipe written out: the model in bf16 (Megatron's Float16Module), fp32 master weights and AdamW,
no dropout. `local_perturbed` (on by default) is the local path again from weights moved by about one bf16 rounding
(relative 2^-9): how far two curves drift from bf16 noise alone, the band the dispatch curve is judged against.
The data are token sequences that step through the vocabulary by a stride of their own (learnable, so the loss
falls within 100 steps); positions are learned absolute embeddings (the same model on every path and CP size).

With --cp N (under torchrun, N ranks): `dispatch` trains with context parallelism (Megatron's parallel_state, its
load-balanced shards from get_batch_on_this_cp_rank, gradients summed over the CP group); Megatron's local core
attention has no context parallelism, so `local` trains the whole sequence on each rank (rank 0 records it).
Megatron's local path keeps every layer's [b, h, s, s] probabilities: if it runs out of memory it is rerun with
Megatron's selective recomputation of the core attention (recorded as `recompute`).

    python benchmarks/bench_megatron.py --out $OUT/megatron.json
    torchrun --nproc-per-node 2 benchmarks/bench_megatron.py --cp 2 --out $OUT/megatron_cp2.json
    python benchmarks/bench_megatron.py --device cpu --tiny --out /tmp/megatron_smoke.json      # the script, on CPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as py_platform
import socket
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", module="megatron")

PATHS = ("dispatch", "local", "local_perturbed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results path (rank 0 writes it)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--timed-from", type=int, default=10, help="steps before this one are warm-up, not timed")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--query-groups", type=int, default=None, help="GQA groups (default: as many as heads)")
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (run under torchrun with as many ranks)")
    p.add_argument("--cp-comm-type", default="p2p", choices=("p2p", "all_gather", "a2a"))
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    p.add_argument("--local-recompute", default="auto", choices=("auto", "on", "off"),
                   help="Megatron's selective recomputation of the local core attention: auto = only after an OOM")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on 128 tokens for 5 steps (smoke test)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.ffn, args.vocab = 2, 64, 4, 256, 256
        args.seq, args.steps, args.timed_from = 128, 5, 1
    bad = [x for x in args.paths.split(",") if x not in PATHS]
    if bad:
        p.error(f"--paths {args.paths!r}: {bad} are not among {', '.join(PATHS)}")
    if args.seq % (2 * args.cp):
        p.error(f"--seq {args.seq} must be a multiple of 2 * --cp ({2 * args.cp}): Megatron's load-balanced shards")
    return args


# --- setup ---------------------------------------------------------------------------------------------
def init_distributed(args) -> tuple[int, int]:
    """(rank, world): torchrun's, or a world of one."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.cp:
        raise SystemExit(f"--cp {args.cp} needs {args.cp} ranks (torchrun --nproc-per-node {args.cp}); got {world}")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=args.cp)
    return rank, world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(args, cp: int, recompute: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = args.device == "cuda"
    extra = dict(recompute_granularity="selective", recompute_modules=["core_attn"]) if recompute else {}
    if cp > 1:
        extra["cp_comm_type"] = args.cp_comm_type
    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, ffn_hidden_size=args.ffn, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32, context_parallel_size=cp,
        use_cpu_initialization=args.device == "cpu", init_method_std=0.02, **extra)


def build_model(args, path: str, cp: int, recompute: bool):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from attn_dispatch.integrations.megatron import with_attn_dispatch

    config = make_config(args, cp, recompute)
    if args.device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    spec = get_gpt_layer_local_spec()
    if path == "dispatch":
        spec = with_attn_dispatch(spec)
    model = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="learned_absolute")
    if args.device == "cuda":
        model = Float16Module(config, model.cuda())
    return model


def core_attention(model):
    inner = getattr(model, "module", model)
    return inner.decoder.layers[0].self_attention.core_attention


# --- data and training -----------------------------------------------------------------------------------
def batch(args, step: int, device: str):
    """Token sequences stepping through the vocabulary by a stride of their own: (tokens, positions, labels)."""
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, args.vocab, (args.micro_batch, 1), generator=g)
    stride = torch.randint(1, 64, (args.micro_batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    positions = torch.arange(args.seq).expand(args.micro_batch, args.seq)
    return seq[:, :-1].to(device), positions.to(device), seq[:, 1:].to(device)


def train(args, model, cp_group, perturb: bool) -> dict:
    """args.steps AdamW steps with fp32 master weights; per-step loss (over the whole sequence) and time."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    if perturb:  # about one bf16 rounding of every weight, from a fixed generator
        g = torch.Generator(device=masters[0].device).manual_seed(args.seed + 1)
        for m in masters:
            m.mul_(1 + (torch.rand(m.shape, generator=g, device=m.device) * 2 - 1) * 2.0 ** -9)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    optimizer = torch.optim.AdamW(masters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 10)
    losses, step_s = [], []
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        tokens, positions, labels = batch(args, step, args.device)
        count = labels.numel()
        if cp_group is not None:
            shard = get_batch_on_this_cp_rank(dict(tokens=tokens, positions=positions, labels=labels))
            tokens, positions, labels = shard["tokens"], shard["positions"], shard["labels"]
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / warmup)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(tokens, positions, None, labels=labels).float().sum() / count
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        if cp_group is not None:
            for m in masters:
                dist.all_reduce(m.grad, group=cp_group)
            loss = loss.detach()
            dist.all_reduce(loss, group=cp_group)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        if cuda:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
        losses.append(float(loss))
    timed = step_s[args.timed_from:] or step_s
    tokens_per_step = args.micro_batch * args.seq
    return dict(losses=losses, step_ms=[round(t * 1e3, 3) for t in step_s],
                median_step_ms=statistics.median(timed) * 1e3, mean_step_ms=statistics.fmean(timed) * 1e3,
                tokens_per_s=tokens_per_step / statistics.median(timed),
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def run_path(args, path: str, cp: int, cp_group, initial: dict | None) -> tuple[dict, dict | None]:
    """(results, initial weights): every path starts from the first path's weights."""
    recompute_options = {"on": [True], "off": [False], "auto": [False, True]}[args.local_recompute] \
        if path != "dispatch" else [False]
    for recompute in recompute_options:
        model = None
        try:
            model = build_model(args, path, cp, recompute)
            if initial is None:
                initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
                           if isinstance(v, torch.Tensor)}
            else:
                model.load_state_dict(initial, strict=False)  # Megatron's override returns nothing
                stray = [k for k in sorted(set(initial) ^ set(model.state_dict())) if not k.endswith("_extra_state")]
                if stray:
                    raise RuntimeError(f"{path}: weights do not carry over: {stray[:5]}")
            result = train(args, model, cp_group, perturb=path == "local_perturbed")
            result.update(recompute=recompute, cp_size=cp, params=sum(p.numel() for p in model.parameters()))
            if path == "dispatch":
                decision = core_attention(model).last_decision
                result["decision_summary"] = decision.summary() if decision is not None else None
                result["decision"] = json.loads(decision.model_dump_json()) if decision is not None else None
            return result, initial
        except torch.OutOfMemoryError:
            if recompute is recompute_options[-1]:
                return dict(error="out of memory", recompute=recompute, traceback=traceback.format_exc()[-2000:]), \
                    initial
        finally:
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
    raise AssertionError("unreachable")


# --- the record ----------------------------------------------------------------------------------------------
def machine(args) -> dict:
    from importlib import metadata

    from attn_dispatch import Platform, __version__

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    info = dict(hostname=socket.gethostname(), python=py_platform.python_version(), torch=torch.__version__,
                megatron_core=version("megatron-core"), attn_dispatch=__version__,
                flash_attn=version("flash-attn"), flash_attn_4=version("flash-attn-4"),
                cudnn_frontend=version("nvidia-cudnn-frontend"))
    if args.device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    try:
        info["platform"] = str(Platform.detect())
    except Exception as exc:  # noqa: BLE001 - the record says why
        info["platform"] = f"detect failed: {exc}"
    return info


def compare(results: dict) -> dict:
    """Speed and loss-curve differences against the local path; the perturbed local run is the noise band."""
    out = {}
    local = results.get("local", {})
    for path in ("dispatch", "local_perturbed"):
        run = results.get(path, {})
        if "losses" not in run or "losses" not in local:
            continue
        diffs = [abs(a - b) for a, b in zip(run["losses"], local["losses"])]
        out[path] = dict(max_abs_loss_diff=max(diffs), last10_mean_abs_loss_diff=statistics.fmean(diffs[-10:]),
                         local_over_this_step_time=local["median_step_ms"] / run["median_step_ms"])
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = init_distributed(args)
    from megatron.core import parallel_state

    cp_group = parallel_state.get_context_parallel_group() if args.cp > 1 else None
    record = dict(what="Megatron-core GPT training step: attn_dispatch core attention vs Megatron's local one",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv), settings=vars(args),
                  machine=machine(args), world_size=world, results={})
    initial = None
    for path in args.paths.split(","):
        if path != "dispatch" and args.device == "cpu":
            record["results"][path] = dict(skipped="Megatron's local core attention needs CUDA")
            continue
        cp = args.cp if path == "dispatch" else 1  # Megatron's local core attention has no context parallelism
        result, initial = run_path(args, path, cp, cp_group if cp > 1 else None, initial)
        record["results"][path] = result
        if rank == 0:
            summary = {k: result.get(k) for k in ("median_step_ms", "peak_memory_gib", "recompute", "error")}
            losses = result.get("losses") or [None]
            print(f"{path}: {summary}, loss {losses[0]} -> {losses[-1]}", flush=True)
    record["comparison"] = compare(record["results"])
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(json.dumps(record["comparison"], indent=1))
        dispatch = record["results"].get("dispatch", {})
        if dispatch.get("decision_summary"):  # what ran in layer 1 (the whole Decision is in the JSON)
            print("\n".join(dispatch["decision_summary"].splitlines()[:5]))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
