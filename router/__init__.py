"""The KV-aware PD router (aiohttp): pools from etcd and static flags, kv_aware prefill choice,
bootstrap injection, concurrent dual dispatch, breakers, retries, health checks and metrics."""
