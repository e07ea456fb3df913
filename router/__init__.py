"""The KV-aware PD router, on its own HTTP layer (router/http): pools from etcd and static flags,
kv_aware prefill choice, bootstrap injection, concurrent dual dispatch, breakers, retries, health
checks and metrics."""
