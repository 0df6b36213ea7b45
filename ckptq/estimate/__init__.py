"""``ckptq estimate``: memory per device and disk per checkpoint of a training run (``memory``), from a
model config (``params``, its fields checked by ``config``) and activation accounting (``activations``)."""
