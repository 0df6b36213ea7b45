"""The ``ckptq`` command: parse, call one library function, print. Errors map to one line here."""

from __future__ import annotations

import errno
import json
import re
import os
import sys
import threading
import warnings
from contextlib import contextmanager

import click

from . import __version__
from .codec.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MIN_SIZE
from .errors import CkptqError, UsageError

_FIRST_SIGN_S = 0.5  # a command that has shown nothing by then shows its (still empty) progress bar


@contextmanager
def _progress(quiet: bool, desc: str):
    if quiet:
        yield None
        return
    from tqdm import tqdm

    bars, lock = [], threading.Lock()  # leave=False: a closed bar is erased, so an error prints only its own line

    def bar(total: int | None):
        with lock:
            if not bars:
                bars.append(tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False,
                                 disable=None, dynamic_ncols=True))  # disable=None: only on a terminal
            return bars[0]

    def update(done: int, total: int) -> None:
        b = bar(total)
        b.total = total
        b.update(done - b.n)

    # reading and planning a large input takes seconds before the first byte is written: say so meanwhile
    early = threading.Timer(_FIRST_SIGN_S, bar, (None,))
    early.daemon = True
    early.start()
    try:
        yield update
    finally:
        early.cancel()
        with lock:
            for b in bars:
                b.close()


def _shown(text) -> str:
    """One printable line (``sources.reports.shown``; imported here only when something is printed)."""
    from .sources.reports import shown

    return shown(text)


def _fail(message: str, code: int):
    """One line on stderr (under torchrun: from rank 0 only) and exit ``code``; ranks leave their process
    group first, so none aborts (gloo's SIGABRT when a process exits with the group alive)."""
    dist = sys.modules.get("torch.distributed")
    joined = dist is not None and dist.is_available() and dist.is_initialized()
    if not joined or dist.get_rank() == 0:
        click.echo(f"ckptq: error: {_shown(message)}", err=True)
    if joined:
        dist.destroy_process_group()
    sys.exit(code)


def _on_disk(mark: int) -> str:
    """What a failed command leaves, for its message: nothing, or the outputs it completed (the original
    is deleted only after everything else succeeded, so it is still there)."""
    from .format import atomic

    done = atomic.written_since(mark)
    if not done:
        return "no output was written"
    return f"{', '.join(done[:3])}{' ...' if len(done) > 3 else ''} written and complete; the original was kept"


def _run(fn, *args, **kwargs):
    """Call a library function; every failure becomes one line on stderr and a non-zero exit."""
    from .format import atomic

    mark = len(atomic.WRITTEN)
    try:
        return fn(*args, **kwargs)
    except CkptqError as e:
        _fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        _fail(f"interrupted; {_on_disk(mark)}", 130)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        hint = "disk full: " if e.errno == errno.ENOSPC else ""
        _fail(f"{hint}{e.strerror or e}{where}; {_on_disk(mark)}", 7)
    except MemoryError:
        _fail(f"out of memory; {_on_disk(mark)}", 8)
    except Exception as e:  # a bug: still one line, and no partial output (writes are atomic)
        _fail(f"internal error ({type(e).__name__}: {e}); {_on_disk(mark)}; please report it", 70)


def _return_freed_memory() -> None:
    """Large buffers (>= 1 MB) come from mmap and go back to the OS when freed. glibc otherwise raises
    its mmap threshold after the first big free, and the worker threads' 16 MB temporaries then pile
    up in per-thread heaps: measured +16 MB per tensor during expand (peak 405 MB vs 230 MB)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


_REPLACE_HELP = ("Delete the {what} once the output is written, synced, read back and checked "
                 "(without it nothing is deleted).")


class _Group(click.Group):
    """Ctrl-C anywhere in a command (importing torch, reading the input) is the one line and exit 130 that
    ``_run`` gives, not click's ``Aborted!`` and exit 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (KeyboardInterrupt, click.exceptions.Abort):
            _fail("interrupted; no output was written", 130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptq")
def main():
    """Shrink the Adam state in PyTorch checkpoints to blockwise 8-bit (or 4-bit) safetensors, and back.

    \b
      ckptq convert ckpt.pt                      # -> ckpt.q8.safetensors
      ckptq info ckpt.q8.safetensors             # what is inside, sizes, savings
      ckptq expand ckpt.q8.safetensors -o ckpt_fp32.pt
      ckptq convert out/ --all --keep-last 1 --replace   # a whole run, newest kept

    Shell completion: eval "$(_CKPTQ_COMPLETE=bash_source ckptq)" (zsh_source, fish_source).
    """
    _return_freed_memory()
    warnings.formatwarning = _one_line_warning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Library warnings (e.g. the C kernels falling back to PyTorch) as one line, like errors."""
    text = _shown(message)
    return f"{text if text.startswith('ckptq: ') else 'ckptq: ' + text}\n".replace("ckptq: ckptq:", "ckptq:")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """'300MB', '5GB', '1.5GiB', '123' -> bytes."""
    m = _SIZE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise UsageError(f"size {text!r} is not understood; write it like 300MB, 5GB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def _report(r, quiet: bool, as_json: bool) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun the ranks share one job: rank 0 reports it
        return
    if as_json:
        click.echo(json.dumps(r.as_dict(), indent=1))
    elif not quiet:
        click.echo(r.text())
    for line in getattr(r, "warnings", []) if not as_json else []:
        click.echo(f"warning: {_shown(line)}", err=True)


@main.command(short_help="Store Adam moments at 8 or 4 bits per value.")
@click.argument("src", type=click.Path())
@click.option("-o", "--output", help="Output path (default: SRC with .q8.safetensors, or .q4, beside it).")
@click.option("--bits", default=None, type=int,
              help="Bits per value of the moments: 8, or 4 (half the size: the first moment's ratio in 6 bits, "
                   "the second moment in 2; SRC may also be a converted file). Default: 8, or 4 for 4-bit "
                   "input state (torchao's AdamW4bit): never wider than the input's.")
@click.option("--block-size", default=None, type=int,
              help="Values per absmax scale: a power of two, 64..4096 (default: 256 for 8 bits, 128 for 4).")
@click.option("--min-size", default=DEFAULT_MIN_SIZE, show_default=True, type=int,
              help="States with fewer elements stay exact fp32.")
@click.option("--key", help="'/'-separated key path of the optimizer state dict (default: found by shape).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where quantization runs (cuda uses the Triton kernels).")
@click.option("--compress/--no-compress", default=False, show_default=True,
              help="Lossless zstd stage on top (byte-planed floats, codes as they are): ~20% smaller, "
                   "slower to write and read, and tensors are no longer memory-mapped on load.")
@click.option("--level", default=3, show_default=True, type=int, help="zstd level with --compress.")
@click.option("--threads", default=0, show_default=True, type=int, help="zstd threads (0: all cores).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Split larger outputs into HF-style shards + index (e.g. 300MB, 20GB; 0 = never).")
@click.option("--all", "all_", is_flag=True,
              help="SRC is a run's output folder: convert every checkpoint folder in it (checkpoint-N/, ...).")
@click.option("--keep-last", default=0, show_default=True, type=int,
              help="With --all: leave the newest N checkpoint folders as they are (to resume from).")
@click.option("--trust", is_flag=True, help="Allow full unpickling (only for files you trust).")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output (only a file convert could have written).")
@click.option("--replace", is_flag=True, help=_REPLACE_HELP.format(what="fp32 original"))
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, no summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def convert(src, output, bits, block_size, min_size, key, device, compress, level, threads, max_shard_size, all_,
            keep_last, trust, force, replace, quiet, as_json):
    """Store the fp32 Adam moments in SRC at 8 bits per value (--bits 4: 4): a torch.save file or a converted
    file -> safetensors; a Trainer, accelerate or Lightning checkpoint folder -> each optimizer file beside
    it (optimizer.pt -> optimizer.q8.safetensors); a torch.distributed.checkpoint folder -> a DCP folder
    (SRC.q8; under torchrun the ranks share the work); a DeepSpeed ZeRO checkpoint -> its optimizer
    partitions beside them; with --all, every checkpoint folder of a run."""
    from . import convert as run  # the public function (ckptq.convert), imported on first use

    shard = _run(parse_size, max_shard_size) or None
    with _progress(quiet or as_json, "convert") as progress:
        r = _run(run, src, output, bits=bits, replace=replace, force=force, compress=level if compress else False,
                 all_checkpoints=all_, keep_last=keep_last, max_shard_size=shard, trust=trust, block_size=block_size,
                 min_size=min_size, key=key, device=device, compress_threads=threads, progress=progress)
    _report(r, quiet, as_json)


@main.command(short_help="Turn low-bit state back into fp32 (what the framework resumes from).")
@click.argument("src", type=click.Path())
@click.option("-o", "--output", help="Output .pt path (default: SRC with .fp32.pt).")
@click.option("--no-verify", is_flag=True, help="Skip checksum verification (faster, unsafe).")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output (only a torch.save file).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, no summary.")
@click.option("--trust", is_flag=True, help="For a .pt input: allow full unpickling (torchao state needs it).")
@click.option("--replace", is_flag=True, help=_REPLACE_HELP.format(what="converted file"))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def expand(src, output, no_verify, force, quiet, trust, replace, as_json):
    """Turn a converted file (or shard index/folder), or a torch.save file holding 8-bit state (ckptq's,
    bitsandbytes', torchao's), back into an ordinary fp32 torch.save checkpoint. A Trainer, accelerate or
    Lightning checkpoint folder: back into the files its resume reads (optimizer.pt, optimizer.bin, *.ckpt);
    a DCP folder or a DeepSpeed checkpoint: back to fp32 folders."""
    from . import expand as run  # the public function (ckptq.expand), imported on first use

    with _progress(quiet or as_json, "expand") as progress:
        r = _run(run, src, output, force=force, verify=not no_verify, trust=trust, replace=replace, progress=progress)
    _report(r, quiet, as_json)


@main.command(short_help="Show what a checkpoint holds and what convert would save.")
@click.argument("path", type=click.Path())
@click.option("--bits", default=8, show_default=True, type=int,
              help="For fp32 state: the budget convert would use (8 or 4), for the predicted size.")
@click.option("--min-size", default=DEFAULT_MIN_SIZE, show_default=True, type=int, help="As in convert.")
@click.option("--block-size", default=None, type=int, help="As in convert (default: 256 for 8 bits, 128 for 4).")
@click.option("--key", help="As in convert.")
@click.option("--trust", is_flag=True, help="Allow full unpickling of a .pt (only for files you trust).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def info(path, bits, min_size, block_size, key, trust, as_json):
    """Show what is inside a checkpoint (a file, a framework's checkpoint folder, a run's folder, a DCP
    folder, a DeepSpeed checkpoint): states by role and code width, exact tensors, sizes, the options a
    converted file records, and what convert would write."""
    from . import info as run  # the public function (ckptq.info), imported on first use

    r = _run(run, path, key=key, min_size=min_size, block_size=block_size, trust=trust, bits=bits)
    click.echo(json.dumps(r.as_dict(), indent=1) if as_json else r.text())


# --- ckptq estimate ---------------------------------------------------------------------------------

@main.command()
@click.argument("model")
@click.option("-b", "--batch-size", default=1, show_default=True, type=int, help="Sequences per device per micro-step.")
@click.option("-s", "--seq-len", type=int, help="Tokens per sequence (default: the config's context, at most 2048).")
@click.option("-n", "--world-size", default=1, show_default=True, type=int, help="Devices the run is sharded over.")
@click.option("--zero-stage", default=0, show_default=True, type=int,
              help="What is sharded over the devices: 0 nothing (DDP), 1 optimizer state and master weights, "
                   "2 + gradients, 3 + weights (FSDP full sharding).")
@click.option("--precision", type=click.Choice(["bf16-mixed", "fp16-mixed", "fp32"]), default="bf16-mixed",
              show_default=True, help="Mixed: 16-bit weights, gradients and activations, fp32 master weights.")
@click.option("--attention", type=click.Choice(["sdpa", "eager"]), default="sdpa", show_default=True,
              help="sdpa: flash/memory-efficient kernels (no seq² scores kept); eager: scores kept.")
@click.option("--block-size", default=DEFAULT_BLOCK_SIZE, show_default=True, type=int, help="8-bit state: as in convert.")
@click.option("--min-size", default=DEFAULT_MIN_SIZE, show_default=True, type=int, help="8-bit state: as in convert.")
@click.option("--optimizer", type=click.Choice(["adamw", "muon", "sgd", "lion", "adafactor"]), default="adamw",
              show_default=True, help="Whose state to count: Muon as runs pair it (AdamW for embeddings, head, "
                                      "1-D), SGD with momentum, Adafactor factored (transformers' defaults).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (bytes).")
def estimate(model, batch_size, seq_len, world_size, zero_stage, precision, attention, block_size, min_size, optimizer,
             as_json):
    """What full fine-tuning with AdamW (or --optimizer) needs per device, and its checkpoint on disk. MODEL: a
    Hugging Face config.json, a folder holding one, or a parameter count (7B, 125M)."""
    from . import estimate as run  # the public function (ckptq.estimate), imported on first use

    r = _run(run, model, batch_size=batch_size, seq_len=seq_len, world_size=world_size, zero_stage=zero_stage,
             precision=precision, attention=attention, optimizer=optimizer, block_size=block_size, min_size=min_size)
    click.echo(json.dumps(r.as_dict(), indent=1) if as_json else r.text())
