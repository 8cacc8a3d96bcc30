"""Train a small GPT twice -- attention by flashtile.modules.MHA, then by PyTorch's
scaled_dot_product_attention -- from the same initial weights on the same batches, and compare.

The data is made up on the fly (no downloads): each sequence is runs of --span random tokens
(Zipf distributed), each run followed by an exact repeat of itself. The fresh runs can only be
learned down to the unigram entropy; the repeats can go to ~0 once the model learns to look back
--span positions and copy (an induction head), so the loss curve also shows that causal attention
over a distance works.

Writes into --out: results.json (config, environment, per-step losses and throughput),
loss.png (matplotlib, if installed) and results.md (GPU, date, versions, command, summary).

    python examples/train_gpt.py --out examples/results/gpt-h200        # H200 defaults, a few minutes
    python examples/train_gpt.py --smoke --out /tmp/gpt-smoke            # 2 tiny steps, CPU interpreter ok
"""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's CPU interpreter; set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Run from a checkout without installing: the repository's flashtile comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashtile  # noqa: E402
from flashtile.modules import MHA, InferenceParams, RotaryEmbedding  # noqa: E402


# ------------------------------------------------------------------------------------------ model
class SDPAAttention(nn.Module):
    """MHA's math with PyTorch's scaled_dot_product_attention; the same parameter names as
    flashtile.modules.MHA (Wqkv, out_proj), so one state_dict loads into both."""

    def __init__(self, embed_dim, num_heads, num_heads_kv, rotary_emb_dim, device=None, dtype=None, **_):
        super().__init__()
        self.num_heads, self.num_heads_kv, self.head_dim = num_heads, num_heads_kv, embed_dim // num_heads
        self.rotary_emb = RotaryEmbedding(rotary_emb_dim, device=device) if rotary_emb_dim else None
        self.Wqkv = nn.Linear(embed_dim, embed_dim + 2 * num_heads_kv * self.head_dim, device=device, dtype=dtype)
        self.out_proj = nn.Linear(embed_dim, embed_dim, device=device, dtype=dtype)

    def forward(self, x, inference_params=None):
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        qkv = self.Wqkv(x).unflatten(-1, (h + 2 * hk, d))
        q, kv = qkv[..., :h, :], qkv[..., h:, :].unflatten(-2, (2, hk))
        if self.rotary_emb is not None:
            q, kv = self.rotary_emb(q, kv)
        k, v = kv.unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=hk != h)
        return self.out_proj(out.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    def __init__(self, cfg, layer_idx, attention, device):
        super().__init__()
        d = cfg["d_model"]
        self.ln1, self.ln2 = nn.LayerNorm(d, device=device), nn.LayerNorm(d, device=device)
        kwargs = dict(num_heads_kv=cfg["kv_heads"], rotary_emb_dim=d // cfg["heads"], device=device)
        if attention == "flashtile":
            self.attn = MHA(d, cfg["heads"], causal=True, layer_idx=layer_idx, **kwargs)
        else:
            self.attn = SDPAAttention(d, cfg["heads"], **kwargs)
        self.fc1 = nn.Linear(d, 4 * d, device=device)
        self.fc2 = nn.Linear(4 * d, d, device=device)

    def forward(self, x, inference_params=None):
        x = x + self.attn(self.ln1(x), inference_params=inference_params)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token embedding, N pre-LayerNorm blocks (attention + 4x GELU MLP), tied LM head; RoPE positions."""

    def __init__(self, cfg, attention, device):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["d_model"], device=device)
        self.blocks = nn.ModuleList([Block(cfg, i, attention, device) for i in range(cfg["layers"])])
        self.ln_f = nn.LayerNorm(cfg["d_model"], device=device)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                # GPT-2's scheme: residual branch outputs shrink with depth.
                std = 0.02 / math.sqrt(2 * cfg["layers"]) if name.endswith(("out_proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, inference_params=None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, inference_params)
        return F.linear(self.ln_f(x), self.embed.weight)  # tied LM head


# ------------------------------------------------------------------------------------------- data
def zipf_probs(vocab, device):
    weights = 1.0 / (torch.arange(vocab, device=device, dtype=torch.float64) + 10.0)
    return (weights / weights.sum()).float()


def make_batch(step, cfg, probs, device):
    """(inputs, targets), each (batch, seqlen): runs of span random tokens, each followed by its
    repeat. Seeded by step, so both runs see the same batches."""
    gen = torch.Generator(device=device).manual_seed(cfg["seed"] * 1_000_003 + step)
    span, batch = cfg["span"], cfg["batch"]
    runs = -(-(cfg["seqlen"] + 1) // (2 * span))
    fresh = torch.multinomial(probs, batch * runs * span, replacement=True, generator=gen).view(batch, runs, 1, span)
    seq = fresh.expand(batch, runs, 2, span).reshape(batch, -1)[:, :cfg["seqlen"] + 1]
    return seq[:, :-1], seq[:, 1:]


def repeat_targets(cfg, device):
    """(seqlen,) bool: targets that repeat a token seen span positions earlier."""
    return ((torch.arange(cfg["seqlen"], device=device) + 1) // cfg["span"]) % 2 == 1


# --------------------------------------------------------------------------------------- training
def train(attention, cfg, init_state, probs, device, amp_dtype):
    torch.manual_seed(cfg["seed"])
    model = GPT(cfg, attention, device)
    model.load_state_dict(init_state)  # the same initial weights for both runs
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    warmup = max(1, cfg["steps"] // 10)

    def lr_at(step):  # linear warmup, cosine decay to 10%
        if step < warmup:
            return cfg["lr"] * (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg["steps"] - warmup)
        return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    repeat = repeat_targets(cfg, device)
    log = dict(loss=[], loss_fresh=[], loss_repeat=[], step_s=[])
    start = time.perf_counter()
    for step in range(cfg["steps"]):
        inputs, targets = make_batch(step, cfg, probs, device)
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
        per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        per_token = per_token.view_as(targets)
        loss = per_token.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        per_token = per_token.detach()
        parts = torch.stack([loss.detach(), per_token[:, ~repeat].mean(), per_token[:, repeat].mean()])
        loss_v, fresh_v, repeat_v = parts.tolist()  # one host sync per step: the step is done
        log["step_s"].append(time.perf_counter() - t0)
        log["loss"].append(loss_v)
        log["loss_fresh"].append(fresh_v)
        log["loss_repeat"].append(repeat_v)
        if step % cfg["log_every"] == 0 or step == cfg["steps"] - 1:
            print(f"[{attention}] step {step:4d}  loss {loss_v:.4f}  (fresh {fresh_v:.3f}, repeats {repeat_v:.3f})"
                  f"  {cfg['batch'] * cfg['seqlen'] / log['step_s'][-1]:,.0f} tok/s", flush=True)
    log["wall_s"] = time.perf_counter() - start
    log["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    log["eval_loss"] = evaluate(model, cfg, probs, device, amp_dtype)
    return model, log


@torch.no_grad()
def evaluate(model, cfg, probs, device, amp_dtype):
    model.eval()
    losses = []
    for i in range(cfg["eval_batches"]):  # held-out batches: steps the training never draws
        inputs, targets = make_batch(10**7 + i, cfg, probs, device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def copy_accuracy(model, cfg, probs, device, amp_dtype, use_cache):
    """Greedy decoding of a repeat: prompt = span random tokens plus the first 4 of their repeat;
    the model should continue the copy. use_cache: flashtile's kv-cache path (prefill, then one
    flash_attn_with_kvcache call per layer and token); else the whole prefix again each token."""
    model.eval()
    span = cfg["span"]
    new = max(1, min(cfg["generate"], span - 4))
    gen = torch.Generator(device=device).manual_seed(cfg["seed"] + 99)
    batch = max(1, min(cfg["batch"], 4))
    first = torch.multinomial(probs, batch * span, replacement=True, generator=gen).view(batch, span)
    target = first[:, 4:4 + new]
    seq = torch.cat([first, first[:, :4]], dim=1)
    params = InferenceParams(max_seqlen=seq.shape[1] + new, max_batch_size=batch) if use_cache else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        logits = model(seq, inference_params=params)
        out = []
        for _ in range(new):
            token = logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
            if use_cache:
                params.seqlen_offset = seq.shape[1] + len(out) - 1
                logits = model(token, inference_params=params)
            else:
                logits = model(torch.cat([seq] + out, dim=1))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    model.train()
    generated = torch.cat(out, dim=1)
    return dict(accuracy=(generated == target[:, :generated.shape[1]]).float().mean().item(),
                ms_per_token=1e3 * elapsed / new, tokens=new, batch=batch, prompt=seq.shape[1])


# ----------------------------------------------------------------------------------------- report
def summarize(log, cfg):
    skip = min(cfg["timing_skip"], max(len(log["step_s"]) - 1, 0))  # first steps compile/autotune the kernels
    steady = log["step_s"][skip:]
    median = statistics.median(steady)
    tail = log["loss"][-min(10, len(log["loss"])):]
    return dict(tokens_per_s=cfg["batch"] * cfg["seqlen"] / median, median_step_ms=1e3 * median,
                first_step_s=log["step_s"][0], final_loss=sum(tail) / len(tail), eval_loss=log["eval_loss"],
                final_repeat_loss=log["loss_repeat"][-1], wall_s=log["wall_s"],
                peak_memory_gib=log["peak_memory_gib"])


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, run in results["runs"].items():
        log = run["log"]
        steps = range(len(log["loss"]))
        style = dict(label=name, linewidth=1, linestyle="-" if name == "flashtile" else "--")  # overlapping curves
        axes[0].plot(steps, log["loss"], **style)
        axes[1].plot(steps, log["loss_repeat"], **style)
        tokens = results["config"]["batch"] * results["config"]["seqlen"]
        axes[2].plot(steps, [tokens / s for s in log["step_s"]], **style)
    axes[0].set(title="training loss", xlabel="step", ylabel="cross entropy (nats)")
    axes[1].set(title="loss on repeated tokens", xlabel="step", ylabel="cross entropy (nats)")
    axes[2].set(title="throughput", xlabel="step", ylabel="tokens / s", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPT {results['config']['layers']}x{results['config']['d_model']}, seqlen "
                 f"{results['config']['seqlen']}, {results['environment']['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_markdown(results, path, plotted):
    cfg, env = results["config"], results["environment"]
    lines = [f"# GPT training: flashtile MHA vs PyTorch SDPA ({env['device_name']})", "",
             f"- date: {env['date']}", f"- device: {env['device_name']}",
             f"- torch {env['torch']}, triton {env['triton']}, flashtile {env['flashtile']}, python {env['python']}",
             f"- command: `{env['command']}`",
             f"- model: {cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} heads "
             f"({cfg['kv_heads']} kv heads), vocab {cfg['vocab']}, RoPE, {results['parameters'] / 1e6:.1f}M parameters",
             f"- training: {cfg['steps']} steps, batch {cfg['batch']} x seqlen {cfg['seqlen']}, precision "
             f"{cfg['precision']}, AdamW lr {cfg['lr']}, seed {cfg['seed']}",
             f"- data: runs of {cfg['span']} random Zipf tokens, each followed by its repeat (learnable only by "
             f"attending back {cfg['span']} positions); the fresh tokens' floor is the unigram entropy, "
             f"{results['unigram_entropy']:.3f} nats",
             f"- tokens/s: median step after the first {cfg['timing_skip']} steps (those include compiling "
             "and autotuning the kernels)", "",
             "| attention | tokens/s | median step (ms) | first step (s) | final loss (last 10) | eval loss | "
             "repeats' loss (last step) | peak memory (GiB) | copy accuracy | decode ms/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in results["runs"].items():
        s, g = run["summary"], run["generation"]
        mem = "n/a" if s["peak_memory_gib"] is None else f"{s['peak_memory_gib']:.1f}"
        lines.append(f"| {name} | {s['tokens_per_s']:,.0f} | {s['median_step_ms']:.1f} | {s['first_step_s']:.1f} | "
                     f"{s['final_loss']:.4f} | {s['eval_loss']:.4f} | {s['final_repeat_loss']:.4f} | {mem} | "
                     f"{g['accuracy']:.3f} | {g['ms_per_token']:.1f} ({g['mode']}) |")
    lines += ["", f"Largest |loss difference| between the runs over the first 10 steps: "
                  f"{results['early_loss_max_abs_diff']:.2e} (same weights and batches; they drift apart later "
                  "only by rounding).", ""]
    if plotted:
        lines += ["![loss and throughput](loss.png)", ""]
    Path(path).write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (results.json, loss.png, results.md)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--span", type=int, default=256, help="length of the random runs that repeat")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["bf16-autocast", "fp32"], default=None,
                   help="default: bf16-autocast on the GPU, fp32 on the CPU (the interpreter has no bf16 matmul)")
    p.add_argument("--generate", type=int, default=64, help="tokens decoded greedily at the end (copy accuracy)")
    p.add_argument("--timing-skip", type=int, default=10, help="first steps left out of tokens/s")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the eval loss")
    p.add_argument("--attention", default="flashtile,sdpa", help="runs, in order: flashtile, sdpa")
    p.add_argument("--smoke", action="store_true", help="a couple of tiny steps (CPU interpreter in seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seqlen, args.d_model, args.layers, args.heads = 2, 2, 16, 32, 2, 2
        args.vocab, args.span, args.generate, args.timing_skip, args.log_every, args.eval_batches = 64, 8, 2, 0, 1, 1
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16-autocast" if device.type == "cuda" else "fp32")
    amp_dtype = {"bf16-autocast": torch.bfloat16, "fp32": None}[precision]
    cfg = dict(steps=args.steps, batch=args.batch, seqlen=args.seqlen, d_model=args.d_model, layers=args.layers,
               heads=args.heads, kv_heads=args.kv_heads or args.heads, vocab=args.vocab, span=args.span, lr=args.lr,
               seed=args.seed, precision=precision, generate=args.generate, eval_batches=args.eval_batches,
               timing_skip=args.timing_skip, log_every=args.log_every)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import triton  # after TRITON_INTERPRET is settled
    env = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else
               f"CPU ({platform.processor() or platform.machine()}, Triton interpreter)",
               torch=torch.__version__, triton=triton.__version__, flashtile=flashtile.__version__,
               cuda=torch.version.cuda, python=platform.python_version(),
               command=" ".join(["python", "examples/train_gpt.py"] +
                                [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]))
    print(f"{env['device_name']}: torch {env['torch']}, triton {env['triton']}; config {cfg}", flush=True)

    torch.manual_seed(cfg["seed"])
    init_state = {k: v.clone() for k, v in GPT(cfg, "flashtile", device).state_dict().items()}
    n_params = sum(v.numel() for k, v in init_state.items())
    probs = zipf_probs(cfg["vocab"], device)
    entropy = -(probs.double() * probs.double().log()).sum().item()

    runs = {}
    for attention in [a.strip() for a in args.attention.split(",") if a.strip()]:
        if attention not in ("flashtile", "sdpa"):
            raise SystemExit(f"unknown attention {attention!r}: flashtile or sdpa")
        model, log = train(attention, cfg, init_state, probs, device, amp_dtype)
        generation = copy_accuracy(model, cfg, probs, device, amp_dtype, use_cache=attention == "flashtile")
        generation["mode"] = "kv cache" if attention == "flashtile" else "full recompute"
        runs[attention] = dict(summary=summarize(log, cfg), generation=generation, log=log)
        print(f"[{attention}] {runs[attention]['summary']}  copy accuracy {generation['accuracy']:.3f}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    early = float("nan")
    if len(runs) == 2:
        a, b = (r["log"]["loss"][:10] for r in runs.values())
        early = max(abs(x - y) for x, y in zip(a, b))
    results = dict(config=cfg, environment=env, parameters=n_params, unigram_entropy=entropy, runs=runs,
                   early_loss_max_abs_diff=early)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plotted = plot(results, out / "loss.png")
    write_markdown(results, out / "results.md", plotted)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + (f", {out / 'loss.png'}" if plotted else ""))
    return results


if __name__ == "__main__":
    main()
