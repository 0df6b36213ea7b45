"""The grouped steps of the C kernels (``ckq_step_group``, ``ckq_dense_group``: kernels/step.h over the SIMD
layer) against the PyTorch reference (``step_torch.step_group`` / ``dense_group``), bit for bit, on every
target of tests/kernels/test_simd_driver.py: x86 scalar C, AVX2 (with and without F16C), this machine's
-march=native, and aarch64 NEON and aarch64 scalar C cross-compiled and run under qemu-user (those two skip,
saying what is missing, without gcc-aarch64-linux-gnu or qemu-user).

tests/kernels/step_driver.c is compiled with the kernels (steps included) for each target; this test writes each
group's arrays as raw little-endian files and a script line per group, slot and member (rule, flags,
widths, transforms, row length, dtypes; the driver rebuilds the structs that backend_native passes), and
compares every array the step changes (params, codes, scales, outs; fp32 states) with the reference's.

Cases: tests/kernels/test_step.py's C cases (built in tests/kernels/cases.py): every rule of ``rules.RULES``
with each flag word the optimizers use, four variants each (slot widths 8/8/8, 4/4/4, 6/2/2, 2/8/4; blocks
64, 128, 256; fp32, bf16, fp16 params and grads; nearest and stochastic rounding; MAXIMIZE; NaN and Inf in two
of the four), three members per group (flat ending in a short block, rows ending in short blocks, rows of whole
blocks), work items of three blocks (so that items start inside rows); states stored otherwise than declared
(the generic transform passes); and the fp32 (dense) step of every flag word on three dtype pairs, in items of
1000 elements.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from ckptq.kernels import lut, rules, step_torch
from ckptq.kernels.contract import KERNEL_DTYPES, Dense, Group, layout_rows
from tests.kernels.cases import FLAG_WORDS, UNSHAPED, VARIANTS, clone_dense, clone_group, layouts, make_dense, make_group
from tests.kernels.test_simd_driver import FLAGS, KERNELS, TARGETS, Script, prepare, run_target

DRIVER = Path(__file__).with_name("step_driver.c")
ITEM_BLOCKS = 3  # blocks per work item of the low-bit step
ITEM_ELEMENTS = 1000  # elements per work item of the dense step (not a multiple of any vector length)


def _codebook(script: Script, slot, books: dict) -> str:
    """The slot's decode map, code table, thresholds and new codebook as files (once per codebook)."""
    key = tuple(t.numpy().tobytes() for t in (slot.qmap, slot.thresholds, slot.encode))
    if key not in books:
        k = len(books)
        table = lut.native_code_table(slot.thresholds)
        assert table is not None, "a codebook without a code table: the kernels cannot take it"
        decode = torch.cat([slot.qmap, slot.qmap.new_zeros(256 - slot.qmap.numel())])
        books[key] = " ".join(script.file(f"book{k}-{what}", t) for what, t in
                              (("decode", decode), ("table", table), ("thr", slot.thresholds), ("enc", slot.encode)))
    return books[key]


def _eps_fields(rule: rules.Rule) -> list[int]:
    return [rule.fields.index(f) if f in rule.fields else -1 for f in ("decode_eps", "encode_eps")]


def _changed(script: Script, name: str, t: torch.Tensor, want: torch.Tensor, outputs: list) -> str:
    """t's file (an array the step changes); its output and the reference's value to ``outputs``."""
    path = script.file(name, t)
    outputs.append((Path(path + ".got"), t.dtype, want))
    return path


def _step_lines(script: Script, name: str, group: Group, books: dict) -> None:
    want = clone_group(group)
    step_torch.step_group(want)
    rule, f, outputs = rules.RULES[group.rule], script.file, []
    p_dtype, g_dtype = KERNEL_DTYPES[group.members[0].p.dtype], KERNEL_DTYPES[group.grads[0].dtype]
    seeds = "-" if group.seeds is None else f(f"{name}-seeds", group.seeds)
    lines = [f"step {rule.name} {group.flags} {len(group.slots)} {group.block_size} {p_dtype} {g_dtype} "
             f"{len(rule.fields)} {' '.join(map(str, _eps_fields(rule)))} {len(group.members)} "
             f"{f(f'{name}-hyper', group.hyper)} {seeds} {ITEM_BLOCKS}"]
    lines += [f"slot {s.bits} {s.decode} {s.encode_as} {s.divisor} {int(s.seeded)} {_codebook(script, s, books)}"
              for s in group.slots]
    for i, (m, w) in enumerate(zip(group.members, want.members)):
        tag = f"{name}-m{i}"
        out = _changed(script, f"{tag}-out", group.outs[i], want.outs[i], outputs) if group.outs else "-"
        states = [_changed(script, f"{tag}-{what}{j}", t, u, outputs)
                  for j in range(len(group.slots))
                  for what, t, u in (("codes", m.codes[j], w.codes[j]), ("absmax", m.absmax[j], w.absmax[j]))]
        lines.append(f"member {m.p.numel()} {layout_rows(m.p.numel(), m.row_len)[1]} "
                     f"{_changed(script, f'{tag}-p', m.p, w.p, outputs)} {f(f'{tag}-g', group.grads[i])} {out} "
                     + " ".join(states))
    script.add("\n".join(lines), name, outputs)


def _dense_lines(script: Script, name: str, group: Dense) -> None:
    want = clone_dense(group)
    step_torch.dense_group(want)
    rule, outputs = rules.RULES[group.rule], []
    slots = len(group.states[0])
    lines = [f"dense {rule.name} {group.flags} {slots} {KERNEL_DTYPES[group.params[0].dtype]} "
             f"{KERNEL_DTYPES[group.grads[0].dtype]} {len(rule.fields)} {len(group.params)} "
             f"{script.file(f'{name}-hyper', group.hyper)} {ITEM_ELEMENTS}"]
    for i, p in enumerate(group.params):
        tag = f"{name}-m{i}"
        out = _changed(script, f"{tag}-out", group.outs[i], want.outs[i], outputs) if group.outs else "-"
        states = [_changed(script, f"{tag}-s{j}", s, u, outputs) for j, (s, u) in
                  enumerate(zip(group.states[i], want.states[i]))]
        lines.append(f"dmember {p.numel()} {_changed(script, f'{tag}-p', p, want.params[i], outputs)} "
                     f"{script.file(f'{tag}-g', group.grads[i])} {out} " + " ".join(states))
    script.add("\n".join(lines), name, outputs)


def _cases(folder: Path) -> Script:
    script, books = Script(folder), {}
    for rule, flags in FLAG_WORDS:
        for k, (widths, block, dtypes, seeded, maximize) in enumerate(VARIANTS):
            word = flags | (rules.MAXIMIZE if maximize else 0)
            group = make_group(rule, word, widths, layouts(block), block, dtypes, seeded, seed=k, special=k % 2 == 1)
            _step_lines(script, f"{rule}-{flags}-v{k}", group, books)
    for u, (rule, flags, shape) in enumerate(UNSHAPED):
        for seeded in (False, True):
            for widths, block in (((8, 8, 8), 64), ((6, 2, 4), 128)):
                group = make_group(rule, flags, widths, layouts(block), block, (torch.float32,) * 2, seeded,
                                   seed=block, shape=shape)
                _step_lines(script, f"stored-otherwise{u}-{rule}-{flags}-{int(seeded)}-{block}", group, books)
    for rule, flags in FLAG_WORDS:
        for k, dtypes in enumerate(((torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16, torch.float32))):
            group = make_dense(rule, flags | (rules.MAXIMIZE if k == 1 else 0), (1, 7, 1000, 4099), dtypes, seed=k)
            _dense_lines(script, f"dense-{rule}-{flags}-{k}", group)
    return script


def _build(name: str, folder: Path) -> tuple[Path | None, str]:
    """(the step driver built for target ``name``, ""), or (None, the compiler's complaint)."""
    cc, target_flags, _, _, _ = TARGETS[name]
    exe = folder / f"step-driver-{name}"
    done = subprocess.run([cc, *FLAGS, *target_flags, f"-I{KERNELS}", "-o", str(exe), str(DRIVER), "-lm"],
                          capture_output=True, text=True, timeout=600)
    return (exe, "") if done.returncode == 0 else (None, done.stderr[-3000:])


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The groups' files, the script and the expected outputs, and every available target's driver."""
    return prepare(tmp_path_factory.mktemp("steps"), _build, _cases)


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_step_matches_the_reference_on_each_path(target, cases):
    isa, bad = run_target(target, cases)
    names = [path.name[:-4] for _, path in bad]
    assert not names, f"{target} ({isa}): {len(names)} arrays of {len(cases[1])} groups differ, e.g. {names[:8]}"
