"""ckptq inside the training frameworks people already run; each module imports its framework, this
package imports none of them:

- ``ckptq.integrations.transformers``: ``CkptqTrainer`` (or ``CkptqTrainerMixin``), a Hugging Face
  ``Trainer`` whose ``checkpoint-N`` folders hold ``optimizer.q8.safetensors`` and, in place of the fp32
  ``optimizer.pt``, a signpost that stops a stock Trainer.
- ``ckptq.integrations.accelerate``: ``store_8bit(optimizer)``: ``accelerator.save_state`` writes the
  optimizer's Adam moments 8-bit and ``load_state`` restores them.
- ``ckptq.integrations.lightning``: ``CkptqCheckpointIO``, a Lightning (and Fabric) plugin that stores
  the optimizer states 8-bit inside the ``.ckpt``; ``store_8bit_in_fabric()`` for code that builds its Fabric.
- ``ckptq.integrations.litgpt``: ``python -m ckptq.integrations.litgpt pretrain ...``, litgpt with it.

torch's optimizers, ckptq's ``AdamW8bit`` and torchao's ``AdamW8bit``/``AdamW4bit`` resume with their own
state; bitsandbytes' state is stored as bitsandbytes keeps it, and handed back in bitsandbytes' form when a
file holds it converted (``_bnb``).
"""
