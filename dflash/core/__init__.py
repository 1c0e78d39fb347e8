"""The torch-free core shared by trainer and simulator: configuration and its validation, queue
policies and the :class:`~dflash.core.queue_core.QueueCore`, length bucketing and the sampler, mix
and run metrics, the run-record schema, errors, atomic writes.

Nothing here imports torch or another ``dflash`` subpackage (a test checks it), so the simulator
and the sweep run without torch.
"""
