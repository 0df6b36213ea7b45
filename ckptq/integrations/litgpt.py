"""litgpt with its checkpoints' optimizer state stored 8-bit (or 4-bit): litgpt's command line, through ckptq.

    python -m ckptq.integrations.litgpt pretrain --config cfg.yaml          # instead of: litgpt pretrain ...
    python -m ckptq.integrations.litgpt --bits 4 pretrain --config cfg.yaml --resume auto

Each ``step-N/lit_model.pth`` then holds the Adam moments low-bit (a signpost carrying them where litgpt's
``optimizer`` entry was) and ``--resume`` reads them back. Stock litgpt stops at such a file with ckptq's
message; ``ckptq expand step-N --replace`` writes the fp32 ``lit_model.pth`` back.

How the plugin gets in: each litgpt command builds its own Fabric (``L.Fabric(devices=..., strategy=...,
precision=..., loggers=...)``, ``L`` being ``lightning``) and offers no way to add a plugin to it: no command
argument or config key takes one, and Fabric reads none from the environment (its ``LT_*`` variables set the
accelerator, strategy, devices and precision only). So while litgpt's ``main`` runs in this launcher's
process, ``lightning.Fabric``, the name litgpt calls, is ``LowBitFabric``: a ``Fabric`` subclass that gives
itself the plugin (``lightning.low_bit_checkpoints``) where its strategy saves through one. Fabric's own
class is not touched, code that imported it keeps it, and ``lightning.Fabric`` is Fabric again when litgpt
returns. Processes that litgpt's Fabric launches run this module again and read ``--bits`` from
``CKPTQ_LITGPT_BITS``. Multi-device litgpt runs use FSDP, which writes its own files without a plugin: those
checkpoints are litgpt's fp32 ones, which ``ckptq convert --all --replace`` shrinks.
In your own code, pass the plugin instead: ``lightning.Fabric(..., plugins=[CkptqCheckpointIO(bits=4)])``.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from ._requires import framework_missing
from .lightning import low_bit_checkpoints, plugin_refusal

BITS_VARIABLE = "CKPTQ_LITGPT_BITS"  # --bits, for the processes litgpt's Fabric launches (they get litgpt's argv)


def main(argv: list[str] | None = None) -> None:
    """Run litgpt's command line (``argv``: its arguments, default ``sys.argv[1:]``), a leading ``--bits 8|4``
    taken here, with every Fabric it makes storing its optimizer states at that width."""
    args = list(sys.argv[1:] if argv is None else argv)
    bits = _bits(os.environ.get(BITS_VARIABLE, "8"))
    if args[:1] == ["--bits"] and len(args) > 1:
        bits, args = _bits(args[1]), args[2:]
    elif args[:1] and args[0].startswith("--bits="):
        bits, args = _bits(args[0].split("=", 1)[1]), args[1:]
    try:
        from litgpt.__main__ import main as litgpt_main
    except ImportError as e:
        raise SystemExit(str(framework_missing("ckptq.integrations.litgpt", "litgpt", "litgpt", e))) from None
    saved = sys.argv, os.environ.get(BITS_VARIABLE)
    sys.argv, os.environ[BITS_VARIABLE] = ["litgpt", *args], str(bits)  # litgpt's CLI parses sys.argv
    try:
        with litgpt_fabric(bits):
            litgpt_main()
    finally:
        sys.argv = saved[0]
        if saved[1] is None:
            os.environ.pop(BITS_VARIABLE, None)
        else:
            os.environ[BITS_VARIABLE] = saved[1]


def _bits(text: str) -> int:
    if text not in ("8", "4"):
        raise SystemExit(f"ckptq.integrations.litgpt: --bits {text!r}: use --bits 8 or --bits 4")
    return int(text)


def fabric_class(bits: int):
    """``LowBitFabric``: ``lightning.Fabric`` that, once made, stores its optimizer states at ``bits`` bits
    (``low_bit_checkpoints``) where its strategy saves through a CheckpointIO plugin and it was given no
    plugin of its own; a sharded strategy (FSDP, DeepSpeed) keeps writing its own files."""
    from lightning.fabric import Fabric

    class LowBitFabric(Fabric):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if plugin_refusal(self.strategy) is None:
                low_bit_checkpoints(self, bits=bits)

    LowBitFabric.__qualname__ = LowBitFabric.__name__
    return LowBitFabric


@contextmanager
def litgpt_fabric(bits: int):
    """Within the block, ``lightning.Fabric`` (what litgpt's ``L.Fabric(...)`` calls) is ``fabric_class(bits)``;
    afterwards Fabric again. Fabric's own class is never changed."""
    import lightning

    original = lightning.Fabric
    lightning.Fabric = fabric_class(bits)
    try:
        yield
    finally:
        lightning.Fabric = original


if __name__ == "__main__":
    main()
