"""ckptq's tests, one subpackage per component; shared helpers in tests.helpers, torchrun workers in tests.workers."""
