"""The rank runtime of a PD instance: one process per rank under ``torch.distributed``
(``dist``), the leader's scheduler replicated to the other TP ranks (``replica``), their
transfer reports back to it (``uplink``), the launcher that spawns and watches the rank
processes (``launch``, ``rank_watch``). The prefill and decode workers (``engine.pd``) run on it."""
