"""``kvatlas sidecar``: one process beside a foreign engine instance (SGLang, vLLM) that makes it a
kvatlas instance, everything under one etcd lease:

- ``record.py``: the instance record (role, engine URL, bootstrap address, model, block size,
  tokenizer, ready/healthy) built from what the engine and its bootstrap server say;
- ``ranks.py``: a prefill's rank table, polled from the engine's own SGLang bootstrap server and
  mirrored into etcd (the keys ``bootstrap/mirror.py`` writes for kvatlas's own prefills);
- ``probe.py``: the engine's ``/health`` and ``/get_server_info``;
- ``service.py``: the lifecycle. Wait for the engine; attach (lease, record, ranks, the KV
  events of every attention-DP rank indexed through ``index/``); mark the record unhealthy when
  the engine stops answering; past a grace, revoke the lease (record, ranks and blocks vanish)
  and wait for the engine to come back.

The sidecar imports ``index/``, ``bootstrap/`` and ``tokenization/``; nothing imports it but the
CLI.
"""
