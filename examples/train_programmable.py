"""Train a small causal language model whose attention uses two of flashtile's extensions: a learnable
sink per head (gpt-oss), and a block mask that keeps each packed document to itself
(flashtile.mods.document_mask with flashtile.create_block_mask). Shows that the gradients flow (the
sinks move) and that the loss falls, and checks the first step's loss against a PyTorch twin of the
same model (a float32 reference attention with the same sinks and mask).

The data is made up on the fly: each sequence packs documents of random lengths; a document is a
run of random tokens followed by its exact repeat, so its second half can be predicted only by
looking back inside the same document.

Writes into --out: results.json (config, environment, per-step loss and mean sink per layer) and
results.md (GPU, date, versions, command, summary).

    python examples/train_programmable.py --out examples/results/programmable-h200   # a minute on a GPU
    python examples/train_programmable.py --smoke --out /tmp/programmable-smoke       # CPU interpreter ok
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on the CPU interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import flashtile  # noqa: E402
from flashtile.mods import MaskMod  # noqa: E402
from flashtile.reference import attention_naive  # noqa: E402

CONFIGS = {
    "gpu": dict(vocab=512, d_model=256, heads=4, layers=2, seqlen=1024, batch=8, steps=2500, lr=2e-3),
    "smoke": dict(vocab=64, d_model=64, heads=2, layers=1, seqlen=64, batch=2, steps=2, lr=2e-3),
}


class Attention(nn.Module):
    """Causal self-attention with a learnable sink per head and a block mask (flashtile), or the same
    math by the float32 reference (``reference=True``) for the check."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.sink = nn.Parameter(torch.zeros(heads))

    def forward(self, x, documents, block_mask, reference=False):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        if reference:
            def same_document_twin(b, h, i, j):  # (batch, 1, seqlen, seqlen), the index tensors unneeded
                return documents[:, None, :, None] == documents[:, None, None, :]
            out, _ = attention_naive(q, k, v, causal=True, learnable_sink=self.sink, mask_mod=same_document_twin,
                                     dtype=torch.float32)
            out = out.to(x.dtype)
        else:
            out = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=self.sink, block_mask=block_mask)
        return self.out(out.flatten(-2))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.embed = nn.Embedding(cfg["vocab"], d)
        self.pos = nn.Embedding(cfg["seqlen"], d)
        self.attn = nn.ModuleList([Attention(d, cfg["heads"]) for _ in range(cfg["layers"])])
        self.mlp = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                  for _ in range(cfg["layers"])])
        self.norms = nn.ModuleList([nn.LayerNorm(d) for _ in range(cfg["layers"])])
        self.head = nn.Linear(d, cfg["vocab"])

    def forward(self, tokens, documents, block_mask, reference=False):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for attn, norm, mlp in zip(self.attn, self.norms, self.mlp):
            x = x + attn(norm(x), documents, block_mask, reference)
            x = x + mlp(x)
        return self.head(x)


def make_batch(step, cfg, device):
    """(tokens, documents): documents of 16 to seqlen / 4 tokens, each a random run and its repeat."""
    gen = torch.Generator().manual_seed(step)
    tokens, documents = torch.empty(cfg["batch"], cfg["seqlen"], dtype=torch.long), []
    for b in range(cfg["batch"]):
        ids, start, doc = torch.empty(cfg["seqlen"], dtype=torch.int32), 0, 0
        while start < cfg["seqlen"]:
            half = int(torch.randint(8, max(9, cfg["seqlen"] // 8), (1,), generator=gen))
            run = torch.randint(0, cfg["vocab"], (half,), generator=gen)
            piece = torch.cat([run, run])[:cfg["seqlen"] - start]
            tokens[b, start:start + len(piece)] = piece
            ids[start:start + len(piece)] = doc
            start, doc = start + len(piece), doc + 1
        documents.append(ids)
    return tokens.to(device), torch.stack(documents).to(device)


@triton.jit
def same_document(b, h, q_idx, kv_idx, aux):
    """aux = (document ids (batch, seqlen) int32, seqlen as int32 (1,)): a query sees the keys of its own
    document in its own sequence (flashtile.mods.document_mask's, for a batch of sequences)."""
    row = b * tl.load(aux[1])
    return tl.load(aux[0] + row + q_idx) == tl.load(aux[0] + row + kv_idx)


def document_block_mask(documents):
    """The batch's block mask: built once per batch, shared by every layer and by the backward."""
    batch, seqlen = documents.shape
    lengths = torch.tensor([seqlen], dtype=torch.int32, device=documents.device)
    mask = MaskMod(same_document, (documents.contiguous(), lengths))
    return flashtile.create_block_mask(mask, batch, None, seqlen, seqlen, device=documents.device)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny configuration, two steps (CPU ok)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 2500; smoke: 2)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    cfg = dict(CONFIGS["smoke" if args.smoke else "gpu"])
    if args.steps is not None:
        cfg["steps"] = args.steps
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    log = {"loss": [], "sink_mean": []}
    first_check = None
    for step in range(cfg["steps"]):
        tokens, documents = make_batch(step, cfg, device)
        mask = document_block_mask(documents)
        with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
            logits = model(tokens, documents, mask)
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())
        if step == 0:
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
                ref_logits = model(tokens, documents, mask, reference=True)
                ref_loss = F.cross_entropy(ref_logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())
            first_check = {"flashtile": loss.item(), "reference": ref_loss.item()}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log["loss"].append(loss.item())
        log["sink_mean"].append([attn.sink.mean().item() for attn in model.attn])
        if step % 250 == 0 or step == cfg["steps"] - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  sinks {log['sink_mean'][-1]}", flush=True)
    return _write(args, cfg, device, log, first_check)


def _write(args, cfg, device, log, first_check):
    args.out.mkdir(parents=True, exist_ok=True)
    losses = log["loss"]
    summary = {"first_loss": losses[0], "last_loss": losses[-1],
               "last_20_mean": sum(losses[-20:]) / len(losses[-20:]),
               "sinks_first": log["sink_mean"][0], "sinks_last": log["sink_mean"][-1],
               "first_step_check": first_check}
    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "flashtile": flashtile.__version__,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "command": "python examples/train_programmable.py " + shlex.join(args.argv)}
    results = {"config": cfg, "env": env, "log": log, "summary": summary}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"# train_programmable ({env['gpu'] or 'CPU, Triton interpreter'}, {env['date']})", "",
             f"- torch {env['torch']}, Triton {env['triton']}, Python {env['python']}, flashtile {env['flashtile']}",
             f"- command: `{env['command']}`",
             f"- config: {json.dumps(cfg)}", "",
             "| | value |", "|---|---|",
             f"| first-step loss, flashtile / float32 reference | {first_check['flashtile']:.4f} / "
             f"{first_check['reference']:.4f} |",
             f"| loss, first step -> mean of the last 20 | {losses[0]:.3f} -> {summary['last_20_mean']:.3f} |",
             "| mean sink logit per layer, after the first step -> last | "
             f"{', '.join(f'{x:.3f}' for x in summary['sinks_first'])} -> "
             f"{', '.join(f'{x:.3f}' for x in summary['sinks_last'])} |"]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
