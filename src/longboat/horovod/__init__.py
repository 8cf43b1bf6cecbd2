"""Horovod's API on longboat: ``import longboat.horovod.torch as hvd`` (see
:mod:`longboat.horovod.torch`)."""
