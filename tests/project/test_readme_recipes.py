"""Every command that README.md and docs/ show, run as written.

A recipe is the fenced code blocks between ``<!-- recipe: NAME -->`` and ``<!-- /recipe -->``; every bash
and python block of those pages must sit in one. Each recipe runs in a fresh folder holding what its
commands expect, built by tests/helpers/recipe_fixtures.py: nanoGPT-style checkpoints from tools/scripts/make_checkpoint.py,
the folders Trainer, accelerate and Lightning write (with tests/helpers/models.py's TinyLM), a run folder of
checkpoint-N/, a DCP folder from ``dcp.save`` in one process, DeepSpeed's files from tests/fixtures/zero/.

Shell lines: ``ckptq ...`` through ckptq's command (``ckptq.cli.main`` in this process: what ``python -m
ckptq`` runs; the nanoGPT test below goes through ``python -m ckptq`` itself), ``rm`` through the shell,
``torchrun`` only with CKPTQ_TEST_TORCHRUN=1 (tests/dcp/test_distributed.py runs ``convert`` under torchrun).
A ```text block after a bash block is the output its last command must print. Python blocks are exec'd in
the folder, or, where they need a framework or several processes (``NAMES_ONLY``), compiled with every
``ckptq`` name they use resolved in the source (the integration tests train with the frameworks). Inline
``ckptq ...`` commands are parsed by the CLI, and inline ``python tools/...`` commands must name a tool and
options that exist.
"""

import ast
import os
import pathlib
import re
import shlex
import subprocess
import sys
import warnings

import click
import pytest
import torch
from click.testing import CliRunner

import ckptq
from ckptq import _deprecated
from ckptq.cli import main
from ckptq.optim import AdamW8bit
from tests.helpers.recipe_fixtures import CHECKS, FIXTURES, ROOT, _tool, scope_for

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages other sessions write, whose commands are long measurements (they run for minutes).
NOT_RUN = {"fidelity-from-scratch.md"}
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->(.*?)<!-- /recipe -->", re.S)
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
NAMES_ONLY = {"trainer", "accelerate", "lightning", "trainer-mixin", "accelerate-store", "lightning-plugin", "fsdp2",
              "fabric", "cuda-graph"}  # cuda-graph: CUDA graphs need a GPU (tests/kernels/test_triton_cuda.py runs the same steps)


def _pages():
    return [p for p in PAGES if p.name not in NOT_RUN]


def all_recipes() -> dict:
    """{name: [(language, code)]} over README.md and docs/; names are unique."""
    found = {}
    for page in _pages():
        for name, body in RECIPE.findall(page.read_text()):
            assert name not in found, f"recipe {name} appears twice ({page.name})"
            found[name] = BLOCK.findall(body)
    return found


def recipe_blocks(name):
    return all_recipes()[name]


# --- running the lines ----------------------------------------------------------------------------

def run_shell(code, cwd) -> str:
    """Each command line as written (comments stripped); returns the output of the last ckptq command."""
    printed = ""
    for line in code.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] == "ckptq":
            r = CliRunner().invoke(main, argv[1:])
            assert r.exit_code == 0, f"{line}: {r.output}"
            printed = r.output
        elif argv[0] in ("pip", "make"):
            check_setup_line(argv, line)
        elif argv[0] == "torchrun":
            if not os.environ.get("CKPTQ_TEST_TORCHRUN"):
                continue
            cmd = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
            p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, f"{line}: {p.stderr[-2000:]}"
        else:
            assert argv[0] in ("rm", "mv", "cp", "mkdir", "ls"), f"{line}: not a command recipes may use"
            p = subprocess.run(["bash", "-c", line.split("#")[0]], cwd=cwd, capture_output=True, text=True)
            assert p.returncode == 0, f"{line}: {p.stderr}"
    return printed


def check_setup_line(argv, line):
    """Installing and the Makefile are not run here (.ci/run runs `make test`; `make demo` trains for a
    while): a `pip install` names this checkout, an editable one, or a git URL with its extras as pyproject
    declares them (`test_package_data_names_every_subpackage` checks what it would ship); a `make` target
    exists and its ckptq lines parse."""
    import tomllib

    if argv[0] == "pip":
        assert argv[1] == "install" and len(argv) in (3, 4), line
        target = argv[-1]
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        m = re.fullmatch(r"(?:\.|ckptq @ git\+https://\S+)(?:\[(\w+)\])?|\.\[(\w+)\]", target)
        assert m and (argv[2] != "-e" or target == ".") and {m.group(1), m.group(2)} - {None} <= extras, line
        return
    recipe = re.search(rf"^{argv[1]}:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, f"{line}: no such target in the Makefile"
    for step in recipe.group(1).splitlines():
        cli = re.match(r"\t\$\(BIN\)/ckptq (.*)", step)
        if cli:
            args = shlex.split(cli.group(1))
            main.get_command(None, args[0]).make_context(args[0], args[1:])


def _module_file(dotted: str) -> pathlib.Path | None:
    parts = dotted.split(".")
    base = ROOT / "kernels" if parts[:2] == ["ckptq", "kernels"] else ROOT / "ckptq"
    rest = parts[2:] if parts[:2] == ["ckptq", "kernels"] else parts[1:]
    for candidate in (base.joinpath(*rest).with_suffix(".py") if rest else None, base.joinpath(*rest, "__init__.py")):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def _is_deprecated_alias(node: ast.AST) -> bool:
    """A function kept for a release under an old name: its body calls ``_deprecated.warn``."""
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "warn"
               and isinstance(c.func.value, ast.Name) and c.func.value.id == "_deprecated" for c in ast.walk(node))


def _defines(dotted: str, name: str) -> bool:
    """Whether module ``dotted`` of this checkout has ``name``: a submodule, a top-level definition, or a name
    its ``__getattr__`` serves (the lazy tables of ``ckptq`` and ``ckptq.dcp``). Old names kept for a release
    (a ``_RENAMED`` table, a function that warns through ``ckptq._deprecated``) do not count: recipes show the
    current names."""
    if _module_file(f"{dotted}.{name}"):
        return True
    path = _module_file(dotted)
    if path is None:
        return False
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return not _is_deprecated_alias(node)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and name in [(a.asname or a.name) for a in node.names]:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
            lazy = any(isinstance(t, ast.Name) and t.id.startswith("_") and t.id != "_RENAMED" for t in targets)
            if lazy and any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node.value)):
                return True
    return False


def _resolves(dotted: str) -> bool:
    """``ckptq.a.b.C``: every step of the chain exists in the source."""
    parts = dotted.split(".")
    return all(_defines(".".join(parts[:i]), parts[i]) for i in range(1, len(parts)))


def ckptq_names(code: str) -> list[str]:
    """Every dotted ckptq name a piece of Python uses: imports and attribute chains from ``ckptq``."""
    tree = ast.parse(code)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ckptq":
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "ckptq" and "." in a.name]
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "ckptq":
                names.append(".".join(["ckptq", *reversed(chain)]))
    return names


# --- the tests ----------------------------------------------------------------------------------

def test_every_code_block_is_a_recipe_with_a_fixture():
    for page in _pages():
        outside = RECIPE.sub("", page.read_text())
        loose = [lang for lang, _ in BLOCK.findall(outside) if lang in ("bash", "sh", "python", "console")]
        assert not loose, f"{page.name}: {len(loose)} code block(s) outside a recipe; wrap them in <!-- recipe: NAME -->"
    names = set(all_recipes())
    assert names - {"nanogpt"} == set(FIXTURES), f"recipes without a fixture: {names - set(FIXTURES) - {'nanogpt'}}; " \
                                                 f"fixtures without a recipe: {set(FIXTURES) - names}"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_recipe_runs_as_written(name, tmp_path, monkeypatch):
    """Each recipe as written; a name kept only for a release (its DeprecationWarning) fails it."""
    blocks = recipe_blocks(name)
    monkeypatch.setattr(_deprecated, "_WARNED", set())  # each old name warns once per process: here, afresh
    warnings.filterwarnings("error", message=".* is deprecated and will be removed", category=DeprecationWarning)
    FIXTURES[name](tmp_path)
    monkeypatch.chdir(tmp_path)
    scope = scope_for(name)
    printed = None
    for lang, code in blocks:
        if lang == "bash":
            printed = run_shell(code, tmp_path)
        elif lang == "text":
            assert printed is not None and printed.rstrip() == code.rstrip(), f"{name}: the output is now\n{printed}"
        elif lang == "python" and name in NAMES_ONLY:
            compile(code, name, "exec")
            for dotted in ckptq_names(code):
                assert _resolves(dotted), f"{name}: {dotted} does not exist"
        elif lang == "python":
            exec(compile(code, name, "exec"), scope)
        else:
            raise AssertionError(f"{name}: a ```{lang} block; recipes hold bash, python or text")
    if name in CHECKS:
        CHECKS[name](tmp_path, scope)


INLINE_CLI = re.compile(r"`(ckptq (?:convert|expand|info|estimate) [^`]*)`")
INLINE_TOOL = re.compile(r"`(?:PYTHONPATH=\. )?(?:HF_HUB_OFFLINE=1 )?python3? (tools/[\w/]+\.py)([^`]*)`")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def test_inline_commands_parse():
    """`ckptq ...` in running text parses with the real CLI (options and arguments exist); `python tools/X.py
    --opt` names a tool that exists and options its source declares. (FIGURE placeholders are left out.)"""
    seen = 0
    for page in _pages():
        text = HTML_COMMENT.sub("", page.read_text())
        for cmd in INLINE_CLI.findall(text):
            argv = shlex.split(cmd.split(" #")[0])[1:]
            sub = main.get_command(None, argv[0])
            try:
                sub.make_context(argv[0], argv[1:])  # click's UsageError for a bad option or value
            except click.MissingParameter:
                pass  # running text may leave out the path: `ckptq convert --bits 4`
            seen += 1
        for tool, args in INLINE_TOOL.findall(text):
            source = (ROOT / tool).read_text()
            for opt in re.findall(r"(?<![\w-])(--[\w-]+)", args):
                assert f'"{opt}"' in source or f"'{opt}'" in source, f"{page.name}: {tool} has no {opt}"
            seen += 1
    assert seen > 10


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    """Every relative link names a file of this checkout and, with #anchor, one of its headings (pages other
    sessions write may not exist yet)."""
    for page in PAGES:
        for target in LINK.findall(HTML_COMMENT.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if dest.name in NOT_RUN and not dest.exists():
                continue
            assert dest.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.name}: {target}"


def test_package_data_names_every_subpackage():
    """`pip install .` (README, Install) must ship every package under ckptq/: pyproject's list names them all."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ckptq").rglob("__init__.py")}
    assert found | {"ckptq.kernels"} <= listed, f"pyproject.toml's packages leave out {sorted(found - listed)}"


# --- nanoGPT: the lines inside an emulation of the code they replace ---------------------------------

def run_shell_subprocess(code, cwd):
    """Each command line as the shell would run it (comments stripped), through ``python -m ckptq``."""
    for line in code.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            assert argv[0] == "ckptq", line
            r = subprocess.run([sys.executable, "-m", "ckptq", *argv[1:]], cwd=cwd, capture_output=True, text=True)
            assert r.returncode == 0, f"{line}: {r.stderr}"


def test_nanogpt_recipe_runs_as_written(tmp_path):
    mk = _tool("make_checkpoint")
    blocks = recipe_blocks("nanogpt")
    assert [lang for lang, _ in blocks] == ["bash", "python", "python", "python", "bash"]
    (convert, model_py, resume, saving, expand) = (code for _, code in blocks)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    torch.save(mk.train(steps=3), out_dir / "ckpt.pt")  # nanoGPT's out/ckpt.pt

    run_shell_subprocess(convert, tmp_path)
    assert os.listdir(out_dir) == ["ckpt.q8.safetensors"]  # no stale fp32 ckpt.pt beside it

    scope = {"os": os, "ckptq": ckptq, "out_dir": str(out_dir)}
    exec(resume, scope)  # train.py, init_from == 'resume'
    checkpoint = scope["checkpoint"]
    model = mk.GPT(**checkpoint["model_args"])
    model.load_state_dict(checkpoint["model"])
    groups = [g for g in mk.make_optimizer(model).param_groups]  # nanoGPT's two groups (decay / no decay)
    scope_model = {"AdamW8bit": AdamW8bit, "learning_rate": mk.LEARNING_RATE, "betas": mk.BETAS, "extra_args": {},
                   "optim_groups": [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups]}
    exec(model_py, scope_model)  # model.py, configure_optimizers()
    optimizer = scope_model["optimizer"]
    optimizer.load_state_dict(checkpoint["optimizer"])
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(checkpoint["model_args"]["vocab_size"], generator=gen)
    for _ in range(3):  # training goes on in 8 bits
        x, y = mk.make_batch(checkpoint["model_args"]["vocab_size"], 4, checkpoint["model_args"]["block_size"], perm, gen)
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scope["checkpoint"] = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "model_args": checkpoint["model_args"], "iter_num": checkpoint["iter_num"] + 3,
                           "best_val_loss": checkpoint["best_val_loss"], "config": checkpoint["config"]}
    exec(saving, scope)  # train.py, saving

    run_shell_subprocess(expand, tmp_path)
    assert os.listdir(out_dir) == ["ckpt.pt"]
    back = torch.load(out_dir / "ckpt.pt", weights_only=True)  # what sample.py and a stock resume read
    assert back["iter_num"] == 6  # the 8-bit run's checkpoint, not the stale one
    for name, w in model.state_dict().items():
        assert torch.equal(back["model"][name], w), name
    fp32 = mk.make_optimizer(mk.GPT(**back["model_args"]))
    fp32.load_state_dict(back["optimizer"])  # torch.optim.AdamW takes the expanded state
    assert all(s["exp_avg"].dtype == torch.float32 for s in fp32.state.values())


def test_names_kept_for_a_release_do_not_count_as_existing():
    """The recipe check resolves current names only: an old name (deprecated alias) in a recipe fails it."""
    for old in ("ckptq.dcp.SavePlanner", "ckptq.dcp.LoadPlanner", "ckptq.integrations.accelerate.store_8bit",
                "ckptq.integrations.lightning.store_8bit_in_fabric"):
        assert not _resolves(old), old
    for new in ("ckptq.dcp.LowBitSavePlanner", "ckptq.dcp.LowBitLoadPlanner", "ckptq.estimate",
                "ckptq.integrations.accelerate.low_bit_checkpoints", "ckptq.integrations.lightning.CkptqCheckpointIO"):
        assert _resolves(new), new
