"""ckptq inside the training frameworks people already run. One shape: one verb per framework, taking
``bits=8`` (default) or ``bits=4``, after which the checkpoints the framework writes anyway hold the
optimizer's Adam moments at that width, and its resume reads them back (files of either width):

- ``ckptq.integrations.transformers``: ``CkptqTrainer(..., bits=8)``, a Hugging Face ``Trainer`` (or
  ``CkptqTrainerMixin`` for a Trainer subclass) whose ``checkpoint-N`` folders hold ``optimizer.q8.safetensors``
  (``.q4``) and, in place of the fp32 ``optimizer.pt``, a signpost that stops a stock Trainer.
- ``ckptq.integrations.accelerate``: ``low_bit_checkpoints(optimizer, bits=8)`` after ``accelerator.prepare``:
  ``accelerator.save_state`` writes the optimizer low-bit and ``load_state`` restores it.
- ``ckptq.integrations.lightning``: ``CkptqCheckpointIO(bits=8)``, a CheckpointIO plugin for
  ``lightning.Trainer(plugins=[...])`` and ``lightning.Fabric(plugins=[...])``; ``low_bit_checkpoints(fabric,
  bits=8)`` gives it to a Fabric made elsewhere.
- ``ckptq.integrations.litgpt``: ``python -m ckptq.integrations.litgpt [--bits 4] pretrain ...``: litgpt's
  command line, its Fabric given the plugin (litgpt offers no hook; the module says how, patching nothing).
- ``torch.distributed.checkpoint`` (``ckptq.dcp``): ``LowBitSavePlanner(bits=8)`` / ``LowBitLoadPlanner()``.

Old names, kept for a release with a DeprecationWarning: ``accelerate.store_8bit`` (``low_bit_checkpoints``),
``lightning.store_8bit_in_fabric(fabric)`` (``low_bit_checkpoints(fabric)``; bare, a UsageError), ``ckptq.dcp.SavePlanner`` /
``LoadPlanner`` (``LowBitSavePlanner`` / ``LowBitLoadPlanner``).

Each module imports its framework; this package imports none of them. torch's optimizers, ckptq's
``AdamW8bit`` and torchao's ``AdamW8bit``/``AdamW4bit`` resume with their own state; bitsandbytes' state is
stored as bitsandbytes keeps it, and handed back in bitsandbytes' form when a file holds it converted
(``_bnb``). ``bits`` applies to fp32 moments: states already low-bit (ckptq's, torchao's) keep their width.
"""
