"""``python -m flashtile.env``: what a bug report needs, one ``name: value`` per line.

Versions (flashtile, Python, torch, Triton and whether flashtile supports it, ptxas, numpy,
transformers), the CUDA driver and GPUs, whether Triton's interpreter is on, the FLASHTILE_*
variables set, and whether this Triton can run the Hopper (Gluon) kernels. With ``--shape`` it
also says which kernels a call of that shape and those options would run, and why
(:func:`flashtile.explain`); ``--json`` prints the same as one JSON object.

    python -m flashtile.env
    python -m flashtile.env --shape 2,4096,16,128 --heads-k 4 --dtype bf16 --causal
    python -m flashtile.env --shape 1,1024,8,64 --dropout 0.1 --device-capability 9.0 --json
"""

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Optional

_TOOL_TIMEOUT_S = 10  # a hung nvidia-smi or ptxas must not hang a bug report


def _version_of(distribution: str) -> Optional[str]:
    """The installed version of an optional dependency, or None. Read from its metadata: importing
    transformers alone takes seconds."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _tool_output(command: list) -> Optional[str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _ptxas() -> str:
    from .triton_compat import ptxas_path

    try:
        path = ptxas_path()
    except Exception as exc:  # no NVIDIA backend in this Triton build
        return f"n/a ({type(exc).__name__}: {exc})"
    if not os.path.isfile(path):
        return f"{path} (missing)"
    output = _tool_output([path, "--version"]) or ""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    # Its first line only names the tool; the "release" line says which CUDA it comes from.
    release = [line for line in lines if "release" in line]
    version = (release or lines or ["--version failed"])[0]
    return f"{path} ({version})"


def _driver_version() -> str:
    if shutil.which("nvidia-smi"):
        output = _tool_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if output and output.strip():
            return output.strip().splitlines()[0]
    import torch

    if torch.cuda.is_available():
        try:
            # The CUDA version the driver supports (e.g. 12040), when nvidia-smi is not there.
            api = torch._C._cuda_getDriverVersion()
            return f"n/a (no nvidia-smi; the driver supports CUDA {api // 1000}.{api % 1000 // 10})"
        except Exception:
            pass
    return "n/a"


def _gpus() -> list:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(dict(index=index, name=props.name, capability=f"{props.major}.{props.minor}",
                         sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1)))
    return gpus


def facts() -> dict:
    """The environment, as JSON-ready values."""
    import torch
    import triton

    import flashtile
    from . import triton_compat
    from .kernels.hopper import status as hopper_status
    from .runtime import interpreter_enabled

    low, high = (f"{major}.{minor}" for major, minor in triton_compat.SUPPORTED)
    available, reason = hopper_status.gluon_status()
    return {
        "flashtile": flashtile.__version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (a CPU build)",
        "triton": triton.__version__,
        "triton_supported": f"{'yes' if triton_compat.version_supported() else 'no'} (flashtile supports {low} to "
                            f"{high})",
        "ptxas": _ptxas(),
        "numpy": _version_of("numpy") or "not installed",
        "transformers": _version_of("transformers") or "not installed",
        "cuda_available": torch.cuda.is_available(),
        "driver": _driver_version(),
        "gpus": _gpus(),
        "interpreter": interpreter_enabled(),
        "flashtile_env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("FLASHTILE_")},
        "gluon": {"available": available, "reason": reason},
    }


def _text_lines(found: dict) -> list:
    lines = []
    for name, value in found.items():
        if name == "gpus":
            lines += [f"gpu{gpu['index']}: {gpu['name']}, compute capability {gpu['capability']} "
                      f"(sm{gpu['capability'].replace('.', '')}), {gpu['sm_count']} SMs, {gpu['memory_gib']} GiB"
                      for gpu in value] or ["gpus: none"]
        elif name == "flashtile_env":
            lines.append(f"{name}: " + (", ".join(f"{k}={v}" for k, v in value.items()) or "none set"))
        elif name == "gluon":
            lines.append(f"gluon: {'available' if value['available'] else 'unavailable'} ({value['reason']})")
        elif name == "interpreter":
            lines.append(f"interpreter: {'active (TRITON_INTERPRET=1)' if value else 'off'}")
        elif isinstance(value, bool):
            lines.append(f"{name}: {'yes' if value else 'no'}")
        else:
            lines.append(f"{name}: {value}")
    return lines


def _parser() -> argparse.ArgumentParser:
    from .tools.common import add_call_arguments, capability

    parser = argparse.ArgumentParser(prog="python -m flashtile.env", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    call = parser.add_argument_group("explain a call (flashtile.explain)")
    add_call_arguments(call)
    call.add_argument("--device-capability", type=capability, metavar="MAJOR.MINOR",
                      help="decide for this GPU instead of the one here (without a GPU: meta tensors)")
    return parser


def _explain(args) -> tuple:
    """(the call in words, flashtile.explain's answer) for the call the arguments describe: on the GPU
    if there is one, else on meta tensors for --device-capability, else on CPU tensors (what the
    interpreter would run)."""
    import torch

    from .tools.common import call_spec

    spec = call_spec(args)
    if torch.cuda.is_available():
        device = "cuda"
    else:
        device = "meta" if args.device_capability is not None else "cpu"
    return spec.describe(), spec.explain(device, args.device_capability)


def _config_json(config):
    if isinstance(config, tuple):
        return [_config_json(c) for c in config]
    if dataclasses.is_dataclass(config):
        return {"type": type(config).__name__, **dataclasses.asdict(config)}
    return config


def _explanation_json(explanation) -> dict:
    return {"device": explanation.device, "autotune": explanation.autotune,
            **{direction: {"path": choice.path, "kernel": choice.kernel, "config": _config_json(choice.config),
                           "reason": choice.reason}
               for direction, choice in (("forward", explanation.forward), ("backward", explanation.backward))}}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    found = facts()
    status = 0
    call = explanation = error = None
    if args.shape is not None:
        try:
            call, explanation = _explain(args)
        except (TypeError, ValueError, RuntimeError) as exc:  # what the call itself would raise
            error, status = f"{type(exc).__name__}: {exc}", 1
            if not found["cuda_available"] and args.device_capability is None:
                error += " (--device-capability 9.0 explains the call for an sm90 GPU from here)"
    if args.json:
        if args.shape is not None:
            found["explain"] = {"error": error} if error else {"call": call, **_explanation_json(explanation)}
        print(json.dumps(found, indent=2))
        return status
    print("\n".join(_text_lines(found)))
    if args.shape is not None:
        print()
        print(f"explain: error: {error}" if error else f"call: {call}\n{explanation}")
    return status


if __name__ == "__main__":
    sys.exit(main())
