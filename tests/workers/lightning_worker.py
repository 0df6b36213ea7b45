"""A Lightning run with ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, gloo on the CPU), launched by
tests/dcp/test_lightning_sharded.py: it saves sharded ``.ckpt/`` folders (DCP + ``meta.pt``) and prints rank 0's
losses as JSON on its last line.

    python -m tests.workers.lightning_worker adamw|adamw8bit DEVICES OUT_DIR MAX_STEPS [RESUME_FROM]
"""

import json
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from ckptq.optim import AdamW8bit


class Net(L.LightningModule):
    def __init__(self, opt: str):
        super().__init__()
        self.opt, self.losses = opt, []
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))

    def configure_model(self):
        for block in self.net:
            if any(True for _ in block.parameters()):
                fully_shard(block)
        fully_shard(self.net)

    def training_step(self, batch, i):
        loss = self.net(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.opt == "adamw8bit":
            return AdamW8bit(self.parameters(), lr=1e-3, min_size=1024)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    opt, devices, out, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 256)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=ModelParallelStrategy(), max_steps=steps,
                        default_root_dir=out, enable_progress_bar=False, logger=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=out, save_last=True)])
    model = Net(opt)
    trainer.fit(model, data, ckpt_path=sys.argv[5] if len(sys.argv) > 5 else None)
    if trainer.global_rank == 0:
        print(json.dumps({"losses": model.losses, "step": trainer.global_step}))


if __name__ == "__main__":
    main()
