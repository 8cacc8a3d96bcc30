"""What the command-line tools share: the device a tool runs on, restarting a command line under
Triton's interpreter when it runs on the CPU, and one dense call described on the command line
(--shape, --causal, ...: env, configs, inspect and tune take the same arguments)."""

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..runtime import interpreter_enabled, interpreter_problem


def choose_device(requested: Optional[str]) -> Tuple[Optional[torch.device], Optional[str]]:
    """(device, None), or (None, why not) for a name torch does not know. Without ``requested``:
    CUDA when available (and the interpreter is off), else the CPU."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"
    try:
        return torch.device(requested), None
    except RuntimeError as exc:
        return None, f"--device {requested!r}: {exc}"


def restart_under_interpreter(device: torch.device, argv) -> None:
    """On the CPU, from a command line (``argv`` None), start this command again with
    TRITON_INTERPRET=1: Triton reads it when the kernels are defined, which `python -m flashtile`
    has done by now (it imports flashtile). A call from Python (``argv`` given) is left alone."""
    if argv is None and device.type == "cpu" and not interpreter_enabled():
        os.execve(sys.executable, list(sys.orig_argv), dict(os.environ, TRITON_INTERPRET="1"))


def device_problem(device: torch.device, prog: str) -> Optional[str]:
    """Why the kernels cannot run on ``device`` here, or None."""
    if device.type == "cuda":
        if interpreter_enabled():
            return ("TRITON_INTERPRET=1 is set: Triton would run the kernels on the CPU; unset it to use the GPU, "
                    "or pass --device cpu")
        if not torch.cuda.is_available():
            return f"--device {device}: CUDA is not available (torch {torch.__version__})"
        return None
    if device.type != "cpu":
        return f"--device {device}: flashtile runs on CUDA devices, or on the CPU through Triton's interpreter"
    if not interpreter_enabled():
        return ("--device cpu needs Triton's interpreter: run with TRITON_INTERPRET=1 set before Python starts "
                f"(TRITON_INTERPRET=1 {prog} ...)")
    return interpreter_problem()


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A tool's parser: its module docstring's first paragraph as the description, the rest as
    the epilog, kept as written."""
    paragraphs = doc.split("\n\n")
    return argparse.ArgumentParser(prog=prog, description=paragraphs[0], epilog="\n\n".join(paragraphs[1:]),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def int_list(count: int, what: str):
    """An argparse type: ``count`` comma-separated integers."""
    def parse(text: str) -> list:
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            values = []
        if len(values) != count:
            raise argparse.ArgumentTypeError(f"{what} must be {count} comma-separated integers, got {text!r}")
        return values
    return parse


def capability(text: str) -> tuple:
    """An argparse type: a compute capability written as 9.0."""
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--device-capability must look like 9.0, got {text!r}") from None
    return major, minor


def add_call_arguments(group, dtypes=("bf16", "fp16", "fp32")) -> None:
    """The arguments that describe one dense flash_attn_func call (read back by call_spec)."""
    group.add_argument("--shape", type=int_list(4, "--shape"), metavar="B,S,H,D",
                       help="q's shape (batch, seqlen_q, nheads, head_dim)")
    group.add_argument("--heads-k", type=int, help="KV heads (MQA/GQA); default nheads")
    group.add_argument("--seqlen-k", type=int, help="keys per sequence; default seqlen_q")
    group.add_argument("--dtype", choices=dtypes, default="bf16")
    group.add_argument("--causal", action="store_true")
    group.add_argument("--window", type=int_list(2, "--window"), metavar="L,R",
                       help="window_size (left, right); -1 is unbounded")
    group.add_argument("--softcap", type=float, default=0.0)
    group.add_argument("--alibi", action="store_true", help="pass ALiBi slopes")
    group.add_argument("--dropout", type=float, default=0.0, metavar="P")
    group.add_argument("--deterministic", action="store_true")


def call_spec(args) -> "CallSpec":
    """The call add_call_arguments' arguments describe."""
    batch, seqlen_q, nheads, head_dim = args.shape
    return CallSpec(batch, seqlen_q, nheads, head_dim, nheads_k=args.heads_k, seqlen_k=args.seqlen_k,
                    dtype=DTYPES[args.dtype], causal=args.causal, window=tuple(args.window or (-1, -1)),
                    softcap=args.softcap, alibi=args.alibi, dropout_p=args.dropout, deterministic=args.deterministic)


@dataclass(frozen=True)
class CallSpec:
    """A dense call of flash_attn_func, as `python -m flashtile.env --shape` describes one."""

    batch: int
    seqlen_q: int
    nheads: int
    head_dim: int
    nheads_k: Optional[int] = None
    seqlen_k: Optional[int] = None
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    dropout_p: float = 0.0
    deterministic: bool = False

    @property
    def k_shape(self) -> tuple:
        return (self.batch, self.seqlen_q if self.seqlen_k is None else self.seqlen_k, self.nheads_k or self.nheads,
                self.head_dim)

    def qkv(self, device="meta") -> tuple:
        """Empty q, k, v of the call's shapes: deciding and capturing read no values (meta tensors
        hold no memory)."""
        q = torch.empty((self.batch, self.seqlen_q, self.nheads, self.head_dim), dtype=self.dtype, device=device)
        return (q, *(torch.empty(self.k_shape, dtype=self.dtype, device=device) for _ in range(2)))

    def options(self, device="meta") -> dict:
        """flash_attn_func's keyword arguments (deterministic apart: it is the backward's)."""
        alibi = torch.zeros(self.nheads, dtype=torch.float32, device=device) if self.alibi else None
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap, alibi_slopes=alibi,
                    dropout_p=self.dropout_p)

    def explain(self, device="meta", device_capability=(9, 0)):
        """flashtile.explain for this call: by default on meta tensors, for an sm90 GPU."""
        from ..explanation import explain

        return explain(*self.qkv(device), **self.options(device), deterministic=self.deterministic,
                       device_capability=device_capability)

    def describe(self) -> str:
        q_shape = (self.batch, self.seqlen_q, self.nheads, self.head_dim)
        flags = [name for name, on in (("causal", self.causal), ("alibi", self.alibi),
                                       ("deterministic", self.deterministic)) if on]
        flags += [f"{name}={value}" for name, value in (("window", self.window if self.window != (-1, -1) else None),
                                                         ("softcap", self.softcap), ("dropout", self.dropout_p))
                  if value]
        return (f"q {q_shape}, k/v {self.k_shape}, {str(self.dtype).replace('torch.', '')}"
                + "".join(f", {flag}" for flag in flags))
