"""``ckptq estimate``: memory per device and disk per checkpoint of a training run (``memory``), from a
model config (``params``) and activation accounting (``activations``)."""
