"""The etcd-backed global index: etcd access, key layout, leased registration, and the KV block index."""
