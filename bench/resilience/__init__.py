"""Surviving a lost machine: the tiers beyond the local disk, measured here and planned at scale.

- ``scale.py``: goodput of a 16,384-GPU job under Llama 3's interruption rate, per tier set (a
  model; its inputs, each with its source, are ``bench/results/scale/inputs.json``).
- ``remote.py`` (+ ``remote_dcp_child.py``, DCP with s3fs in a process of its own): the remote
  tier (S3) against ``torch.save`` + upload and DCP ``async_save`` + ``FsspecWriter`` on a local
  SeaweedFS.
- ``remote_clients.py``: boto3 against obstore, 1 GiB up and down, per part size (the client choice).
- ``tiers.py``: the memory tier on 2 simulated nodes: loop overhead at interval 1 with
  replicas=2 against the disk tier, DCP async_save and none; restore from memory, disk, a peer,
  DCP; the raw gloo link (``bench/results/tiers/latest.json``, whose ``ratios.peer_vs_raw_gloo`` scale reads).
- ``tiers_plot.py``: the figure of a ``tiers.py`` result (``python -m bench.tiers_plot FILE.json``).
- ``tiers_loss.py``: steps lost by the memory tier after a process crash or a node loss (kill trials,
  each restore verified bit for bit; also run by ``tiers.py``, ``--loss-trials``).
- ``preempt.py`` (+ ``preempt_child.py``, the training process it signals): SIGTERM at a random
  point of a step, SIGKILL at the grace period, the machine lost: the time from the signal to
  durable on disk and committed on the remote, the steps lost against DCP ``async_save`` from the
  user's own SIGTERM handler, and the flush's remote commit against the raw client's upload.

Invariants: the model is a pure function of its inputs file; ``--refresh`` takes the measured
efficiencies only from result files of this repository, named in the inputs.
"""
