"""The trainer as a torch.distributed job, one process per device: the one training loop.

Process model (:mod:`~dflash.pipeline.launch` starts it; torchrun may too): the first ``n_target``
ranks are targets (:class:`~dflash.pipeline.workers.Producer`), the rest drafters
(:class:`~dflash.pipeline.workers.DrafterWorker`, :mod:`~dflash.pipeline.drafter_loop`); the first
drafter rank also runs the coordinator thread (:mod:`~dflash.pipeline.service` around the pure
:mod:`~dflash.pipeline.coordinator`). Modules, one job each:

- ``roles``: roles by rank, the device rule, world-size and GPU-per-node checks (torch-free);
- ``launch``: torchrun or torch's elastic launcher, one line per failure;
- ``rank``: one rank's set-up (process groups, models, resume, channel) and end;
- ``coordinator``: the queue decisions for many ranks over the one ``QueueCore`` (pure);
- ``service``: the coordinator thread: channel, feed, records, ledger, live control;
- ``channel``: the control plane (sockets, timeouts, never tensors);
- ``transport``: the data plane (point-to-point rounds; gloo, NCCL, host-staged);
- ``planes``, ``paired``: one data plane per producer -> drafter pair (sharing within a node, copying
  across nodes; the table is torch-free) and the transport that dispatches by pair;
- ``rundir``: every rank sees the one run directory (checked together at start);
- ``workers``, ``drafter_loop``: the producer and drafter loops; ``optim``: the optimizer and the
  learning-rate schedule;
- ``ledger``, ``checkpoint``, ``resume``: exact resume, fail-closed checkpoints, control file;
- ``telemetry``: W&B, NVML, stage timers;
- ``abort``, ``faults``: the abort path (every thread's failure is its rank's, a failed rank's peers leave
  within seconds, a heartbeat names a silently dead rank) and the fault injection that tests it;
- ``trainer``: the library call that starts the job and reads back what it wrote (``validate``'s
  blocks, the demo's calibration run, benchmarks and tests); ``training_data``: the run's data.

Contracts (docs/ARCHITECTURE.md, "The distributed pipeline"): the control plane never carries
tensors; a tensor stays on its producer until assigned and moves in globally numbered rounds, each
rank doing its rounds in increasing order; one writer (the coordinator) of records and of the
ledger; a checkpoint is valid only with its ledger step and only if its manifest verifies (recovery
fails closed); every wait has a timeout and a hung rank says what it waits for (``RUN/.ranks``).
"""
