"""litgpt with its checkpoints' optimizer state stored 8-bit: litgpt's command line, through ckptq.

    python -m ckptq.integrations.litgpt pretrain --config cfg.yaml          # instead of: litgpt pretrain ...
    python -m ckptq.integrations.litgpt pretrain --config cfg.yaml --resume auto

litgpt builds its own ``lightning.Fabric``; this runs litgpt's ``main`` after
``ckptq.integrations.lightning.store_8bit_in_fabric()``, so that each ``step-N/lit_model.pth`` holds the
Adam moments 8-bit (a signpost carrying them where litgpt's ``optimizer`` entry was) and ``--resume`` reads
them back. Stock litgpt stops at such a file with ckptq's message; ``ckptq expand step-N --replace`` writes
the fp32 ``lit_model.pth`` back.
"""

from __future__ import annotations

import sys

from ._requires import framework_missing
from .lightning import store_8bit_in_fabric


def main(argv: list[str] | None = None) -> None:
    try:
        from litgpt.__main__ import main as litgpt_main
    except ImportError as e:
        raise SystemExit(str(framework_missing("ckptq.integrations.litgpt", "litgpt", "litgpt", e))) from None
    store_8bit_in_fabric()
    sys.argv = ["litgpt", *(sys.argv[1:] if argv is None else argv)]
    litgpt_main()


if __name__ == "__main__":
    main()
