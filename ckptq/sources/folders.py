"""Checkpoint folders of the programs people train with: which files hold the optimizer state, and what
each one's converted file is called, in both directions.

- Hugging Face Trainer ``checkpoint-N/``: ``optimizer.pt`` beside model.safetensors, scheduler.pt,
  trainer_state.json, rng_state.pth.
- accelerate ``save_state``: ``optimizer.bin``, ``optimizer_1.bin``, ... (one per prepared optimizer),
  beside model.safetensors, scheduler.bin, random_states_0.pkl; with FSDP's sharded state dict an
  ``optimizer_0/`` torch.distributed.checkpoint folder instead (converted by ``ckptq.dcp.folder``).
- Lightning: ``*.ckpt`` files (``epoch=0-step=100.ckpt``, ``last.ckpt``), torch.save files whose
  ``optimizer_states`` list holds the optimizer state dicts; a ``checkpoints/`` folder of several is a run
  (``ckptq.sources.framework.checkpoint_folders``).
- litgpt (Fabric) ``step-00000N/lit_model.pth``: ``{"model", "optimizer", "iter_num", ...}``; nanoGPT-style
  runs ``checkpoint-N/ckpt.pt``; OLMo-core ``stepN/model_and_optim/``, a DCP folder.

Converted files go beside the originals: ``optimizer.pt`` -> ``optimizer.q8.safetensors`` (``.q4`` at 4
bits), ``optimizer_0/`` -> ``optimizer_0.q8/``; with ``--replace`` a ``.ckpt`` or ``.pth`` is converted in
place instead (``ckptq.sources.inplace``); every other file is left alone. Expand writes back the name the
framework's resume reads: the source name recorded in the converted file, else the framework's name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..codec import checkpoint, quant, signpost
from .. import format
from ..format.container import Container
from ..errors import CkptqError, InputError, NothingToConvertError, UsageError

TRAINER_MARKER = "trainer_state.json"
_ACCELERATE_FILE = re.compile(r"optimizer(_\d+)?\.bin")
_ACCELERATE_DCP = re.compile(r"optimizer(_\d+)?|model_and_optim")  # accelerate's FSDP, OLMo-core's
IN_PLACE = (".ckpt", ".pth")  # --replace converts these in place: Lightning / Fabric files, litgpt's lit_model.pth
_RUN_FILES = ("lit_model.pth", "ckpt.pt")  # litgpt (Fabric), nanoGPT-style runs: weights and optimizer
_OPTIMIZER_STEM = re.compile(r"optimizer(_\d+)?")  # one checkpoint may hold several of these (accelerate)
# one file, a sharded set's index; at 8 or 4 bits
_CONVERTED = tuple(f".q{bits}{suffix}" for suffix in (format.SUFFIX, format.INDEX_SUFFIX) for bits in (8, 4))
_WIDTH_MARKS = (".q8", ".q4")
_DEEPSPEED = re.compile(r"(.*_optim_states\.pt|mp_rank_\d+_model_states\.pt|zero_pp_rank_.*\.pt)")
_CHECKPOINT_DIR = re.compile(r"checkpoint-\d+|global_step\d+|step-?\d+")
_LOOKED_FOR = ("optimizer.pt (Trainer), optimizer.bin / optimizer_N.bin / optimizer_N/ (accelerate), "
               "*.ckpt (Lightning), lit_model.pth (litgpt), ckpt.pt (nanoGPT), model_and_optim/ (OLMo-core)")


@dataclass
class Job:
    src: str
    dst: str
    in_place: bool = False  # a file rewritten under its own name (8-bit <-> fp32; ``ckptq.sources.inplace``)
    over_signpost: bool = False  # expand: the output replaces ckptq's signpost (CkptqTrainer's optimizer.pt)


@dataclass
class Layout:
    folder: str
    framework: str  # "Trainer", "accelerate", "Lightning", "litgpt", "nanoGPT", "OLMo-core" or "plain"
    jobs: list[Job] = field(default_factory=list)


def is_checkpoint_folder(path: str) -> bool:
    """A folder that a training framework wrote (or ckptq converted in place), as opposed to a folder that
    holds one ckptq shard set (its index): it names an optimizer file, a framework file, checkpoint
    subfolders, or converted files of a framework's files. A folder with neither is looked at as one, to
    say what is missing."""
    if not os.path.isdir(path) or checkpoint.is_dcp_folder(path):
        return False
    names = os.listdir(path)
    if not any(n.endswith(format.INDEX_SUFFIX) for n in names):
        return True
    return any(n in ("optimizer.pt", TRAINER_MARKER, "latest") or n.endswith(".ckpt") or _ACCELERATE_FILE.fullmatch(n)
               or n.startswith("random_states_") or _DEEPSPEED.fullmatch(n) or _CHECKPOINT_DIR.fullmatch(n)
               or n.endswith(_CONVERTED[:2]) or _framework_source(os.path.join(path, n)) for n in names)


def _recorded_source(path: str) -> str | None:
    """The source file name a converted file records (``optimizer.pt``, ``last.ckpt``), if a plain name."""
    try:
        conv = Container(path, verify=False)  # its metadata only
    except CkptqError:
        return None
    conv.close()
    source = conv.info.get("source")
    return source if isinstance(source, str) and source and os.path.basename(source) == source else None


def _framework_source(path: str) -> bool:
    """A converted shard set's index whose source was a framework's optimizer file."""
    if not path.endswith(_CONVERTED[2:]) or not os.path.isfile(path):
        return False
    source = _recorded_source(path) or ""
    return source == "optimizer.pt" or bool(_ACCELERATE_FILE.fullmatch(source)) or source.endswith(".ckpt")


def _framework(folder: str) -> str:
    """Which framework wrote the folder, by its files and the sources its converted files record."""
    names = os.listdir(folder)
    names += [_recorded_source(os.path.join(folder, n)) or "" for n in names if _converted_stem(n) is not None]
    if TRAINER_MARKER in names or "optimizer.pt" in names:
        return "Trainer"
    for name, framework in (("lit_model.pth", "litgpt"), ("ckpt.pt", "nanoGPT"), ("model_and_optim", "OLMo-core")):
        if name in names:
            return framework
    if any(n.endswith(".ckpt") for n in names):
        return "Lightning"
    if any(_ACCELERATE_FILE.fullmatch(n) or _ACCELERATE_DCP.fullmatch(n) or n.startswith("random_states_") for n in names):
        return "accelerate"
    return "plain"


def _converted_stem(name: str) -> str | None:
    for suffix in _CONVERTED:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _sources(folder: str) -> list[str]:
    """The files (or DCP subfolders) that hold a framework's optimizer state, sorted."""
    out = []
    for n in sorted(os.listdir(folder)):
        p = os.path.join(folder, n)
        if os.path.isfile(p) and (n in ("optimizer.pt", *_RUN_FILES) or _ACCELERATE_FILE.fullmatch(n)
                                  or n.endswith(".ckpt")) and not signpost.is_signpost_file(p):
            out.append(p)
        elif _ACCELERATE_DCP.fullmatch(n) and checkpoint.is_dcp_folder(p) and not signpost.is_signpost_folder(p):
            out.append(p)
    return out


def _one_checkpoint(folder: str, found: list[str], verb: str) -> None:
    """Several files that are not the optimizers of one checkpoint (accelerate's optimizer, optimizer_1, ...)."""
    stems = [os.path.basename(p).split(".")[0] for p in found]
    if len(found) > 1 and not all(_OPTIMIZER_STEM.fullmatch(s) for s in stems):
        names = ", ".join(os.path.basename(p) for p in found)
        raise UsageError(f"{folder} holds {len(found)} candidates ({names}); pass one: ckptq {verb} {found[0]}")


def _subcheckpoints(folder: str, verb: str) -> None:
    subs = sorted((n for n in os.listdir(folder) if _CHECKPOINT_DIR.fullmatch(n)), key=lambda n: int(re.search(r"\d+$", n).group()))
    if subs:
        raise UsageError(f"{folder} holds {len(subs)} checkpoint folders ({', '.join(subs[:6])}"
                         f"{', ...' if len(subs) > 6 else ''}); pass one: ckptq {verb} {os.path.join(folder, subs[-1])}"
                         + (f", or all of them: ckptq convert {folder} --all" if verb == "convert" else ""))


def _nothing(folder: str, what: str, error: type[InputError] = InputError) -> InputError:
    names = sorted(os.listdir(folder))
    held = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
    extra = {"reason": f"no {what}"} if error is NothingToConvertError else {}
    return error(f"{folder} is not a torch.distributed.checkpoint folder (no .metadata) and holds no {what} "
                      f"(looked for {_LOOKED_FOR}; found {held}); pass the file that holds the optimizer state", **extra)


def for_convert(folder: str, bits: int = 8, replace: bool = False, force: bool = False) -> Layout:
    """The optimizer files of a checkpoint folder and where their converted files go (``.q8`` or ``.q4``;
    with ``replace``, a ``.ckpt`` / ``.pth`` file in place)."""
    found = _sources(folder)
    if not found:
        _subcheckpoints(folder, "convert")
        done = [os.path.basename(p) for p in _converted(folder)]
        if done:
            raise NothingToConvertError(f"{folder} holds its optimizer state converted already ({', '.join(done)}); "
                                        f"`ckptq expand {folder}` turns it back into the framework's files",
                                        reason="already converted")
        raise _nothing(folder, "optimizer file", NothingToConvertError)
    _one_checkpoint(folder, found, "convert")
    jobs = [Job(p, p, in_place=True) if replace and os.path.isfile(p) and p.endswith(IN_PLACE) else
            Job(p, p + f".q{bits}" if os.path.isdir(p) else _converted_name(p, bits)) for p in found]
    if not (replace or force) and all(os.path.lexists(j.dst) and not j.in_place for j in jobs):
        names = ", ".join(os.path.basename(j.dst) for j in jobs)
        raise NothingToConvertError(f"{folder} holds its converted files already ({names}, beside the originals); "
                                    "--replace deletes the originals, --force writes them again",
                                    reason="already converted")
    return Layout(folder, _framework(folder), jobs)


def is_accelerate_file(name: str) -> bool:
    """``optimizer.bin``, ``optimizer_1.bin``...: what accelerate's ``load_state`` loads by name."""
    return bool(_ACCELERATE_FILE.fullmatch(name))


def _converted_name(path: str, bits: int = 8) -> str:
    base = os.path.basename(path)
    return os.path.join(os.path.dirname(path), base.rsplit(".", 1)[0] + f".q{bits}" + format.SUFFIX)


def _converted(folder: str) -> list[str]:
    """Converted optimizer files in a folder: single files, shard sets (by their index), DCP ``.q8``/``.q4``
    folders."""
    out = []
    for n in sorted(os.listdir(folder)):
        p = os.path.join(folder, n)
        if (os.path.isfile(p) and _converted_stem(n) is not None) or (
                n.endswith(_WIDTH_MARKS) and _ACCELERATE_DCP.fullmatch(n[:-3]) and checkpoint.is_dcp_folder(p)):
            out.append(p)
    return out


def _holds_8bit(path: str) -> bool:
    from ..codec import foreign

    obj = checkpoint.load_torch(path)
    return bool(quant.count_qstates(obj) or foreign.to_torch(obj))


def _restored_name(folder: str, path: str) -> str:
    """The file the framework's resume reads, for the converted file ``path``: the source name the file
    records (``optimizer.pt``, ``optimizer.bin``, ``last.ckpt``), else the name the folder's framework uses."""
    if os.path.isdir(path):
        return path[: -len(".q8")]  # .q8 or .q4
    stem = _converted_stem(os.path.basename(path))
    source = _recorded_source(path)
    if source and source.rsplit(".", 1)[0] == stem:
        return os.path.join(folder, source)
    names = os.listdir(folder)
    ext = (".pt" if TRAINER_MARKER in names else ".bin" if any(n.startswith("random_states_") for n in names)
           else ".ckpt" if any(n.endswith(".ckpt") for n in names) else None)
    if ext is None:
        raise UsageError(f"{path} records no source file name and {folder} has no Trainer, accelerate or Lightning "
                         f"files to tell which name to restore; expand it by name: ckptq expand {path} -o NAME")
    return os.path.join(folder, stem + ext)


def for_expand(folder: str, replace: bool) -> Layout:
    """The converted optimizer files of a checkpoint folder and the names their expansions take; or the
    framework's own files when they hold 8-bit state (saved from AdamW8bit), rewritten in place."""
    found = _converted(folder)
    if found:
        _one_checkpoint(folder, found, "expand")
        jobs = [Job(p, dst) for p in found for dst in [_restored_name(folder, p)]]
        for job in jobs:
            job.over_signpost = signpost.is_signpost_file(job.dst) or signpost.is_signpost_folder(job.dst)
        return Layout(folder, _framework(folder), jobs)
    eight = [p for p in _sources(folder) if os.path.isfile(p) and _holds_8bit(p)]
    if not eight:
        _subcheckpoints(folder, "expand")
        raise _nothing(folder, "low-bit optimizer state (*.q8.safetensors, *.q4.safetensors, or a framework file "
                               "holding ckptq's state)")
    _one_checkpoint(folder, eight, "expand")
    if not replace:
        names = ", ".join(os.path.basename(p) for p in eight)
        raise UsageError(f"{names} in {folder} hold 8-bit state; `ckptq expand {folder} --replace` rewrites them as "
                         f"fp32 under the same names (or: ckptq expand {eight[0]} -o OTHER)")
    return Layout(folder, _framework(folder), [Job(p, p, in_place=True) for p in eight])


def for_info(folder: str) -> Layout:
    """Every optimizer file of a checkpoint folder, original or converted (jobs without outputs)."""
    found = sorted(_sources(folder) + _converted(folder))
    if not found:
        _subcheckpoints(folder, "info")
        raise _nothing(folder, "optimizer file")
    return Layout(folder, _framework(folder), [Job(p, "") for p in found])


def parts_of(src: str) -> list[str]:
    """A converted file, or an index and its shards: every file that goes when it is replaced."""
    if os.path.isdir(src):
        return [src]
    conv = Container(src, verify=False)
    conv.close()
    return conv.files


def holds_optimizer_files(folder: str) -> bool:
    """Whether the folder itself holds a framework's optimizer files (original or converted)."""
    return bool(_sources(folder) or _converted(folder))
