"""A training run's footprint: memory per device and disk per checkpoint, what ``ckptq.estimate()`` and
``ckptq estimate`` report (``memory``, returning ``report.Estimate``), from a model config (``params``, its
fields checked by ``config``) and activation accounting (``activations``)."""
